/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The few kernel interfaces that changed between 6.1 and newer kernels.
 */
#ifndef _VGPU_COMPAT_H
#define _VGPU_COMPAT_H

#include <linux/version.h>
#include <linux/device.h>
#include <linux/mm.h>

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

/* 6.3 made vma->vm_flags read-only, to be changed under the mmap lock only. */
#if KERNEL_VERSION(6, 3, 0) <= LINUX_VERSION_CODE
#define vgpu_vm_flags_set(vma, flags)	vm_flags_set(vma, flags)
#else
static inline void vgpu_vm_flags_set(struct vm_area_struct *vma,
				     vm_flags_t flags)
{
	vma->vm_flags |= flags;
}
#endif

#endif /* _VGPU_COMPAT_H */
