/* SPDX-License-Identifier: GPL-2.0 */
/*
 * NVIDIA's ioctl interface as both modules see it: the escape numbers, the
 * IOCTL_XFER_CMD wrapper, and the params of the escapes (the NVOS* structs
 * of the RM escapes among them). Numbers and layouts follow NVIDIA's
 * open-gpu-kernel-modules (595.45.04, nv-ioctl-numbers.h, nv-ioctl.h,
 * nvos.h, uvm_ioctl.h); the definitions are ours. Field names are NVIDIA's
 * in lower case with underscores (hObjectNew: h_object_new). The layouts
 * are pinned with BUILD_BUG_ON by the modules (nvsim_abi_check(),
 * vgpu_check_abi()) and checked with gcc against NVIDIA's declarations by
 * tests/unit/test_nvidia_layouts.py.
 */
#ifndef _NVIDIA_NV_IOCTL_H
#define _NVIDIA_NV_IOCTL_H

#include <linux/types.h>

/* The ioctl type of every escape on nvidiactl and nvidiaN. */
#define NV_IOCTL_MAGIC			'F'

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

/**
 * struct nv_ioctl_xfer - params of NV_ESC_IOCTL_XFER_CMD
 * @cmd: the wrapped escape
 * @size: size of its params
 * @ptr: user pointer to its params
 */
struct nv_ioctl_xfer {
	u32 cmd;
	u32 size;
	u64 ptr;
};

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

/* NVOS64: RM_ALLOC with access rights; begins as NVOS21 does. */
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

/**
 * struct nvos54 - NVOS54, params of NV_ESC_RM_CONTROL
 * @h_client: the RM client
 * @h_object: the object the control is exported on
 * @cmd: the control command
 * @flags: zero
 * @params: user pointer to the command's params
 * @params_size: their size
 * @status: out: the NVIDIA status
 */
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

/* NVOS32: RM_VID_HEAP_CONTROL (only the data union members nvsim serves). */
#define NVOS32_FUNCTION_ALLOC_SIZE		2
#define NVOS32_FUNCTION_FREE			3
#define NVOS32_FUNCTION_INFO			5
#define NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT	6
#define NVOS32_FUNCTION_ALLOC_SIZE_RANGE	14
#define NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED	0x00004000
#define NVOS32_ALLOC_FLAGS_USE_BEGIN_END		0x00020000
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

/* ALLOC_TILED_PITCH_HEIGHT: as AllocSize, but RM computes size = height x pitch. */
struct nvos32_alloc_tiled_pitch_height {
	u32 owner;
	u32 h_memory;
	u32 type;
	u32 flags;
	u32 height;
	s32 pitch;
	u32 attr;
	u32 width;
	u32 format;
	u32 compr_covg;
	u32 zcull_covg;
	u32 partition_stride;
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
	u32 pad0;
};

/* ALLOC_SIZE_RANGE: the range always applies; note size at 40, range before address. */
struct nvos32_alloc_size_range {
	u32 owner;
	u32 h_memory;
	u32 type;
	u32 flags;
	u32 attr;
	u32 format;
	u32 compr_covg;
	u32 zcull_covg;
	u32 partition_stride;
	u32 pad0;
	u64 size;
	u64 alignment;
	u64 offset;
	u64 limit;
	u64 range_begin;
	u64 range_end;
	u64 address;
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
		struct nvos32_alloc_tiled_pitch_height alloc_tiled;
		struct nvos32_alloc_size_range alloc_range;
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

/* Escape 218. */
struct nv_wait_open_complete {
	s32 rc;
	u32 adapter_status;
};

/* nvidia-uvm: commands are plain numbers, not _IOC encoded. */
#define UVM_INITIALIZE			0x30000001

struct uvm_initialize_params {
	u64 flags;
	u32 rm_status;
	u32 pad;
};

#endif /* _NVIDIA_NV_IOCTL_H */
