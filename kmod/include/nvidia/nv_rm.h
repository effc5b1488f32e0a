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

/* Controls. */
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

#endif /* _NVIDIA_NV_RM_H */
