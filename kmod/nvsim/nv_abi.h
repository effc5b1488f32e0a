/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * NVIDIA kernel ABI as seen by nvsim: escape numbers, parameter layouts,
 * classes, controls and status codes.  Numbers and layouts follow
 * NVIDIA's open-gpu-kernel-modules (595.45.04); the definitions are ours.
 * Every layout is pinned by nvsim_abi_check() in main.c.
 */
#ifndef NVSIM_NV_ABI_H
#define NVSIM_NV_ABI_H

#include <linux/types.h>

/* Escapes: the _IOC_NR of the ioctl, or nv_ioctl_xfer.cmd. */
#define NV_ESC_RM_ALLOC_MEMORY		0x27
#define NV_ESC_RM_FREE			0x29
#define NV_ESC_RM_CONTROL		0x2a
#define NV_ESC_RM_ALLOC			0x2b
#define NV_ESC_RM_DUP_OBJECT		0x34
#define NV_ESC_RM_VID_HEAP_CONTROL	0x4a
#define NV_ESC_RM_MAP_MEMORY		0x4e
#define NV_ESC_RM_UNMAP_MEMORY		0x4f
#define NV_ESC_CARD_INFO		200
#define NV_ESC_REGISTER_FD		201
#define NV_ESC_CHECK_VERSION_STR	210
#define NV_ESC_IOCTL_XFER_CMD		211
#define NV_ESC_ATTACH_GPUS_TO_FD	212
#define NV_ESC_WAIT_OPEN_COMPLETE	218

/* Largest parameter block NV_ESC_IOCTL_XFER_CMD may carry. */
#define NV_ABSOLUTE_MAX_IOCTL_SIZE	16384

/* nvidia-uvm commands are plain numbers, not _IOC encoded. */
#define UVM_INITIALIZE			0x30000001

/* Status codes (nvstatuscodes.h). */
#define NV_OK					0x00
#define NV_ERR_GENERIC				0xffff
#define NV_ERR_INSERT_DUPLICATE_NAME		0x19
#define NV_ERR_INSUFFICIENT_RESOURCES		0x1a
#define NV_ERR_INVALID_ADDRESS			0x1e
#define NV_ERR_INVALID_ARGUMENT			0x1f
#define NV_ERR_INVALID_CLASS			0x22
#define NV_ERR_INVALID_CLIENT			0x23
#define NV_ERR_INVALID_FLAGS			0x29
#define NV_ERR_INVALID_FUNCTION			0x2a
#define NV_ERR_INVALID_LIMIT			0x2e
#define NV_ERR_INVALID_OBJECT_HANDLE		0x33
#define NV_ERR_INVALID_OBJECT_PARENT		0x36
#define NV_ERR_INVALID_PARAM_STRUCT		0x3a
#define NV_ERR_INVALID_STATE			0x40
#define NV_ERR_NO_MEMORY			0x51
#define NV_ERR_NOT_SUPPORTED			0x56
#define NV_ERR_STATE_IN_USE			0x63

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

/* Handles the RM generates (resserv). */
#define NV_CLIENT_HANDLE_BASE		0xc1d00000u
#define NV_CLIENT_HANDLE_MAX		0x00100000u
#define NV_UNIQUE_HANDLE_BASE		0xcaf00000u
#define NV_UNIQUE_HANDLE_RANGE		0x00080000u

/* NV_MAX_DEVICES: a deviceId at or above this is an invalid argument. */
#define NV_MAX_DEVICES			32

/* NVOS00: RM_FREE. */
struct nvos00 {
	u32 h_root;
	u32 h_object_parent;
	u32 h_object_old;
	u32 status;
};

/* NVOS21: RM_ALLOC without access rights. */
struct nvos21 {
	u32 h_root;
	u32 h_object_parent;
	u32 h_object_new;
	u32 h_class;
	u64 p_alloc_parms;
	u32 params_size;
	u32 status;
};

/* NVOS64: RM_ALLOC with access rights. */
struct nvos64 {
	u32 h_root;
	u32 h_object_parent;
	u32 h_object_new;
	u32 h_class;
	u64 p_alloc_parms;
	u64 p_rights_requested;
	u32 params_size;
	u32 flags;
	u32 status;
	u32 pad;
};

/* NVOS54: RM_CONTROL. */
struct nvos54 {
	u32 h_client;
	u32 h_object;
	u32 cmd;
	u32 flags;
	u64 params;
	u32 params_size;
	u32 status;
};

/* NVOS55: RM_DUP_OBJECT. */
#define NV04_DUP_HANDLE_FLAGS_REJECT_KERNEL_DUP_PRIVILEGE	0x1

struct nvos55 {
	u32 h_client;
	u32 h_parent;
	u32 h_object;
	u32 h_client_src;
	u32 h_object_src;
	u32 flags;
	u32 status;
};

/* NVOS33 + fd: RM_MAP_MEMORY. */
struct nvos33_with_fd {
	u32 h_client;
	u32 h_device;
	u32 h_memory;
	u32 pad0;
	u64 offset;
	u64 length;
	u64 p_linear_address;
	u32 status;
	u32 flags;
	s32 fd;
	u32 pad1;
};

/* NVOS34: RM_UNMAP_MEMORY. */
struct nvos34 {
	u32 h_client;
	u32 h_device;
	u32 h_memory;
	u32 pad0;
	u64 p_linear_address;
	u32 status;
	u32 flags;
};

/* NVOS02 + fd: RM_ALLOC_MEMORY. */
struct nvos02_with_fd {
	u32 h_root;
	u32 h_object_parent;
	u32 h_object_new;
	u32 h_class;
	u32 flags;
	u32 pad0;
	u64 p_memory;
	u64 limit;
	u32 status;
	u32 pad1;
	s32 fd;
	u32 pad2;
};

/* NVOS32: RM_VID_HEAP_CONTROL (only the fields nvsim reads or writes). */
#define NVOS32_FUNCTION_ALLOC_SIZE		2
#define NVOS32_FUNCTION_FREE			3
#define NVOS32_FUNCTION_INFO			5
#define NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED	0x00004000
#define NVOS32_ALLOC_FLAGS_VIRTUAL			0x00080000
#define NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED	0x00000001

struct nvos32_alloc_size {
	u32 owner;
	u32 h_memory;
	u32 type;
	u32 flags;
	u32 attr;
	u32 format;
	u32 compr_covg;
	u32 zcull_covg;
	u32 partition_stride;
	u32 width;
	u32 height;
	u32 pad0;
	u64 size;
	u64 alignment;
	u64 offset;
	u64 limit;
	u64 address;
	u64 range_begin;
	u64 range_end;
	u32 attr2;
	u32 ctag_offset;
	s32 numa_node;
	u32 pad1;
};

struct nvos32_free {
	u32 owner;
	u32 h_memory;
	u32 flags;
};

struct nvos32_info {
	u32 attr;
	u32 pad0;
	u64 offset;
	u64 size;
	u64 base;
};

struct nvos32 {
	u32 h_root;
	u32 h_object_parent;
	u32 function;
	u32 h_va_space;
	s16 ivc_heap_number;
	u16 pad0;
	u32 status;
	u64 total;
	u64 free;
	union {
		struct nvos32_alloc_size alloc_size;
		struct nvos32_free free;
		struct nvos32_info info;
		u8 raw[144];
	} data;
};

/* Escape 200: one entry per GPU. */
struct nv_card_info {
	u8 valid;
	u8 pad0[3];
	u32 pci_domain;
	u8 pci_bus;
	u8 pci_slot;
	u8 pci_function;
	u8 pad1;
	u16 vendor_id;
	u16 device_id;
	u32 gpu_id;
	u16 interrupt_line;
	u16 pad2;
	u64 reg_address;
	u64 reg_size;
	u64 fb_address;
	u64 fb_size;
	u32 minor_number;
	u8 dev_name[10];
	u8 pad3[2];
};

/* Escape 201. */
struct nv_register_fd {
	s32 ctl_fd;
};

/* Escape 210. */
#define NV_RM_API_VERSION_STRING_LENGTH		64
#define NV_RM_API_VERSION_CMD_STRICT		0
#define NV_RM_API_VERSION_CMD_RELAXED		'1'
#define NV_RM_API_VERSION_CMD_QUERY		'2'
#define NV_RM_API_VERSION_REPLY_RECOGNIZED	1

struct nv_rm_api_version {
	u32 cmd;
	u32 reply;
	char version_string[NV_RM_API_VERSION_STRING_LENGTH];
};

/* Escape 211. */
struct nv_ioctl_xfer {
	u32 cmd;
	u32 size;
	u64 ptr;
};

/* Escape 218. */
struct nv_wait_open_complete {
	s32 rc;
	u32 adapter_status;
};

/* Allocation parameters of the classes nvsim knows. */
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

/*
 * nvsim-private (not NVIDIA's): simulated work on a channel group.
 * NVSIM_ESC_SUBMIT_WORK on nvidiactl queues work_ns of GPU time on
 * hChannelGroup; GET_WORK_STATS (on a channel group) reads its counters.
 */
#define NVSIM_ESC_SUBMIT_WORK			0xf0
#define NVSIM_CTRL_CMD_GET_WORK_STATS		0xa06c01f0

struct nvsim_submit_work {
	u32 h_client;
	u32 h_channel_group;
	u64 work_ns;
	u32 status;
	u32 reserved;
};

struct nvsim_work_stats_params {
	u64 busy_ns;
	u64 pending_ns;
	u32 b_enabled;
	u32 timeslice_us;
};

/* nvidia-uvm. */
struct uvm_initialize_params {
	u64 flags;
	u32 rm_status;
	u32 pad;
};

#endif /* NVSIM_NV_ABI_H */
