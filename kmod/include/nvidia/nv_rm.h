/* SPDX-License-Identifier: GPL-2.0 */
/*
 * NVIDIA RM objects: classes, the handles the RM generates, the allocation
 * params of the classes the modules know, and controls with their params.
 * Numbers and layouts follow NVIDIA's open-gpu-kernel-modules (595.45.04,
 * the class and ctrl headers of sdk/nvidia/inc); the definitions are ours.
 * Layouts are pinned as those of nv_ioctl.h.
 */
#ifndef _NVIDIA_NV_RM_H
#define _NVIDIA_NV_RM_H

#include <linux/types.h>

/* Classes. */
#define NV01_ROOT			0x0000
#define NV01_ROOT_NON_PRIV		0x0001
#define NV01_ROOT_CLIENT		0x0041
#define NV01_MEMORY_SYSTEM		0x003e
#define NV01_MEMORY_LOCAL_PRIVILEGED	0x003f
#define NV01_MEMORY_LOCAL_USER		0x0040
#define NV01_DEVICE_0			0x0080
#define NV20_SUBDEVICE_0		0x2080
#define NV50_MEMORY_VIRTUAL		0x50a0
#define FERMI_VASPACE_A			0x90f1
#define KEPLER_CHANNEL_GROUP_A		0xa06c
#define NV_MEMORY_FABRIC		0x00f8

/* Handles the RM generates (resserv). */
#define NV_CLIENT_HANDLE_BASE		0xc1d00000u
#define NV_CLIENT_HANDLE_MAX		0x00100000u
#define NV_UNIQUE_HANDLE_BASE		0xcaf00000u
#define NV_UNIQUE_HANDLE_RANGE		0x00080000u

/* NV_MAX_DEVICES: a deviceId at or above this is an invalid argument. */
#define NV_MAX_DEVICES			32

/* Allocation parameters. */
struct nv0080_alloc_params {
	u32 device_id;
	u32 h_client_share;
	u32 h_target_client;
	u32 h_target_device;
	u32 flags;
	u32 pad0;
	u64 va_space_size;
	u64 va_start_internal;
	u64 va_limit_internal;
	u32 va_mode;
	u32 pad1;
};

struct nv2080_alloc_params {
	u32 sub_device_id;
};

struct nv_memory_allocation_params {
	u32 owner;
	u32 type;
	u32 flags;
	u32 width;
	u32 height;
	s32 pitch;
	u32 attr;
	u32 attr2;
	u32 format;
	u32 compr_covg;
	u32 zcull_covg;
	u32 pad0;
	u64 range_lo;
	u64 range_hi;
	u64 size;
	u64 alignment;
	u64 offset;
	u64 limit;
	u64 address;
	u32 ctag_offset;
	u32 h_va_space;
	u32 internal_flags;
	u32 tag;
	s32 numa_node;
	u32 pad1;
};

struct nv_vaspace_allocation_params {
	u32 index;
	u32 flags;
	u64 va_size;
	u64 va_start_internal;
	u64 va_limit_internal;
	u32 big_page_size;
	u32 pad0;
	u64 va_base;
	u32 pasid;
	u32 pad1;
};

/* NV00F8_ALLOCATION_PARAMETERS (cl00f8.h): an NV_MEMORY_FABRIC object. */
#define NV_MEMORY_FABRIC_PAGE_SIZE_2M	0x200000ULL
#define NV_MEMORY_FABRIC_PAGE_SIZE_512M	0x20000000ULL
#define NV_MEMORY_FABRIC_PAGE_SIZE_256G	0x4000000000ULL

struct nv00f8_allocation_params {
	u64 alignment;
	u64 alloc_size;
	u64 page_size;
	u32 alloc_flags;
	u32 pad0;
	u64 map_offset;
	u32 map_h_vid_mem;
	u32 map_flags;
};

struct nv_channel_group_allocation_params {
	u32 h_object_error;
	u32 h_object_ecc_error;
	u32 h_va_space;
	u32 engine_type;
	u8 b_is_calling_context_vgpu_plugin;
	u8 pad[3];
};

/*
 * Page size of a memory allocation: NVOS32_ATTR_PAGE_SIZE (attr 24:23) and,
 * for HUGE, NVOS32_ATTR2_PAGE_SIZE_HUGE (attr2 21:20). The driver rounds
 * the size up to the page size chosen (and to the alignment asked for)
 * and reports the size allocated back in the params.
 */
#define NVOS32_ATTR_PAGE_SIZE_SHIFT		23
#define NVOS32_ATTR_PAGE_SIZE_MASK		0x3
#define NVOS32_ATTR_PAGE_SIZE_DEFAULT		0x0
#define NVOS32_ATTR_PAGE_SIZE_4KB		0x1
#define NVOS32_ATTR_PAGE_SIZE_BIG		0x2
#define NVOS32_ATTR_PAGE_SIZE_HUGE		0x3
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_SHIFT	20
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_MASK	0x3
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_DEFAULT	0x0
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_2MB		0x1
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_512MB	0x2
#define NVOS32_ATTR2_PAGE_SIZE_HUGE_256GB	0x3

/* Controls. */
/* On the client (NV01_ROOT_CLIENT): what a handle is (ctrl0000client.h). */
#define NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO		0x00000d02
#define NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_PARENT	0x1
#define NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_CLASSID	0x2

struct nv0000_client_get_handle_info_params {
	u32 h_object;
	u32 index;
	union {
		u32 h_result;
		u64 i_result;
	} data;
};

/* On a memory object: its surface's facts (ctrl0041.h). */
#define NV0041_CTRL_CMD_GET_SURFACE_INFO		0x00410110
#define NV0041_CTRL_SURFACE_INFO_INDEX_ATTRS		0x1
#define NV0041_CTRL_SURFACE_INFO_INDEX_COMPR_COVERAGE	0x5
#define NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_SIZE	0x7
#define NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_ATTR	0x8
#define NV0041_CTRL_SURFACE_INFO_INDEX_ADDR_SPACE_TYPE	0x9
/* PHYS_SIZE is reported in units of this many bytes. */
#define NV0041_CTRL_SURFACE_INFO_PHYS_SIZE_SCALE_FACTOR	0x1000
/* ADDR_SPACE_TYPE values (NV0000_CTRL_CMD_CLIENT_GET_ADDR_SPACE_TYPE_*). */
#define NV0000_CTRL_CMD_CLIENT_GET_ADDR_SPACE_TYPE_SYSMEM	0x1
#define NV0000_CTRL_CMD_CLIENT_GET_ADDR_SPACE_TYPE_VIDMEM	0x2

struct nv0041_surface_info {
	u32 index;
	u32 data;
};

/* surface_info_list points at surface_info_list_size entries. */
struct nv0041_get_surface_info_params {
	u32 surface_info_list_size;
	u32 pad0;
	u64 surface_info_list;
};

#define NV2080_CTRL_CMD_FB_GET_INFO		0x20801301
#define NV2080_CTRL_CMD_FB_GET_INFO_V2		0x20801303
#define NV2080_CTRL_FB_INFO_MAX_LIST_SIZE	128
#define NV2080_CTRL_FB_INFO_INDEX_RAM_SIZE		0x07
#define NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE	0x08
#define NV2080_CTRL_FB_INFO_INDEX_HEAP_SIZE		0x09
#define NV2080_CTRL_FB_INFO_INDEX_HEAP_FREE		0x16
#define NV2080_CTRL_FB_INFO_INDEX_USABLE_RAM_SIZE	0x20
#define NV2080_CTRL_FB_INFO_INDEX_MAX			0x3b

struct nv2080_fb_info {
	u32 index;
	u32 data;
};

struct nv2080_fb_get_info_params {
	u32 list_size;
	u32 pad0;
	u64 list;
};

struct nv2080_fb_get_info_v2_params {
	u32 list_size;
	struct nv2080_fb_info list[NV2080_CTRL_FB_INFO_MAX_LIST_SIZE];
};

#define NVA06C_CTRL_CMD_GPFIFO_SCHEDULE		0xa06c0101
#define NVA06C_CTRL_CMD_SET_TIMESLICE		0xa06c0103
#define NVA06C_CTRL_CMD_GET_TIMESLICE		0xa06c0104
#define NVA06C_DEFAULT_TIMESLICE_US		1024

struct nva06c_gpfifo_schedule_params {
	u8 b_enable;
	u8 b_skip_submit;
	u8 b_skip_enable;
};

struct nva06c_timeslice_params {
	u64 timeslice_us;
};

/*
 * PREEMPT (ctrla06c.h): preempt a channel group off its engine; bWait
 * waits for the preemption to complete, and bManualTimeout asks for
 * timeoutUs (at most NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US) as the
 * wait's timeout instead of the driver's.
 */
#define NVA06C_CTRL_CMD_PREEMPT				0xa06c0105
#define NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US	1000000

struct nva06c_preempt_params {
	u8 b_wait;
	u8 b_manual_timeout;
	u8 pad0[2];
	u32 timeout_us;
};

/*
 * SET_INTERLEAVE_LEVEL (ctrla06c.h): how often the group appears in its
 * runlist. With L groups at LOW and M at MEDIUM, a LOW group appears
 * once, a MEDIUM one L times (once if L is 0) and a HIGH one (M + 1) * L
 * times (M times if L is 0, once if M is 0 too): a HIGH group comes up
 * after every lower group. New groups are MEDIUM (kchangrpapiConstruct).
 * The control needs RS_ACCESS_NICE: a privileged client, or a caller with
 * CAP_SYS_NICE (os_check_access), checked at every call.
 */
#define NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL		0xa06c0107
#define NVA06C_CTRL_INTERLEAVE_LEVEL_LOW		0
#define NVA06C_CTRL_INTERLEAVE_LEVEL_MEDIUM		1
#define NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH		2

struct nva06c_interleave_level_params {
	u32 tsg_interleave_level;
};

#endif /* _NVIDIA_NV_RM_H */
