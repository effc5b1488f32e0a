/* SPDX-License-Identifier: GPL-2.0 */
/*
 * NVIDIA RM status codes (nvstatuscodes.h): what an RM escape writes into
 * the status field of its params. Values follow NVIDIA's
 * open-gpu-kernel-modules (595.45.04); the definitions are ours.
 */
#ifndef _NVIDIA_NV_STATUS_H
#define _NVIDIA_NV_STATUS_H

#define NV_OK					0x00
#define NV_ERR_GENERIC				0xffff
#define NV_ERR_INSERT_DUPLICATE_NAME		0x19
#define NV_ERR_INSUFFICIENT_RESOURCES		0x1a
#define NV_ERR_INSUFFICIENT_PERMISSIONS		0x1b
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

#endif /* _NVIDIA_NV_STATUS_H */
