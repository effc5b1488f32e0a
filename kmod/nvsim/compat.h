/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * The few kernel interfaces that changed between 6.1 and newer kernels, as
 * vgpu/compat.h does for vgpu (nvsim is built on its own, without vgpu's
 * headers).
 */
#ifndef _NVSIM_COMPAT_H
#define _NVSIM_COMPAT_H

#include <linux/version.h>
#include <linux/device.h>
#include <linux/mm.h>

#if KERNEL_VERSION(6, 4, 0) <= LINUX_VERSION_CODE
#define nvsim_class_create(name)	class_create(name)
#else
#define nvsim_class_create(name)	class_create(THIS_MODULE, name)
#endif

#if KERNEL_VERSION(6, 2, 0) <= LINUX_VERSION_CODE
#define NVSIM_DEVNODE_CONST const
#else
#define NVSIM_DEVNODE_CONST
#endif

/* 6.3 made vma->vm_flags read-only, to be changed under the mmap lock only. */
#if KERNEL_VERSION(6, 3, 0) <= LINUX_VERSION_CODE
#define nvsim_vm_flags_set(vma, flags)	vm_flags_set(vma, flags)
#else
static inline void nvsim_vm_flags_set(struct vm_area_struct *vma,
				      vm_flags_t flags)
{
	vma->vm_flags |= flags;
}
#endif

#endif /* _NVSIM_COMPAT_H */
