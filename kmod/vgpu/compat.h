/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The few kernel interfaces that changed between 6.1 and newer kernels.
 */
#ifndef _VGPU_COMPAT_H
#define _VGPU_COMPAT_H

#include <linux/version.h>
#include <linux/device.h>

#if KERNEL_VERSION(6, 4, 0) <= LINUX_VERSION_CODE
#define vgpu_class_create(name)	class_create(name)
#else
#define vgpu_class_create(name)	class_create(THIS_MODULE, name)
#endif

#if KERNEL_VERSION(6, 2, 0) <= LINUX_VERSION_CODE
#define VGPU_DEVNODE_CONST const
#else
#define VGPU_DEVNODE_CONST
#endif

#if KERNEL_VERSION(6, 12, 0) <= LINUX_VERSION_CODE
#include <linux/unaligned.h>
#else
#include <asm/unaligned.h>
#endif

#endif /* _VGPU_COMPAT_H */
