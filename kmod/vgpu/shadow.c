// SPDX-License-Identifier: GPL-2.0
/*
 * Shadows: what the driver reads is what the module read, not the caller's
 * memory again. The driver reads user memory of the current process only,
 * so the copy goes into a private anonymous region mapped in the caller's
 * mm for the duration of the call.
 *
 * Shadow calls (VGPU_RULE_F_SHADOW) hand the driver the blocks the daemon
 * checked:
 *
 *   [ xfer wrapper (XFER calls) | params | the rule's buffer | its list ]
 *
 * The params are written as the upcall carried them, except that the
 * rule's pointer names the shadow's copy of its buffer, and the buffer's
 * pointer to its nested list (VGPU_A_NESTED) names the shadow's copy of the
 * list; an XFER wrapper of our own names the shadow params. The driver is called on the shadow, its
 * results are read back, and the region is unmapped on every path.
 *
 * Every other IOCTL_XFER_CMD call gets a wrapper-only shadow: the wrapper
 * as the module read it (its escape chose the filter's path), still naming
 * the caller's params.
 *
 * Every other call the module read to match it against the filter (no
 * rule's key matched, a rule without the flag, the fail-open policy) runs
 * on a shadow of its params as read, too (chardev.c).
 *
 * Each open file keeps one region mapped between its calls (struct
 * vgpu_shadow_cache), in the mm of the process that first used it: a call
 * that finds it free reuses it, so that the common call pays two copies
 * and no mmap, fault, munmap and TLB flush. A call that finds it busy (a
 * sibling thread's call in flight) or comes from another mm maps a region
 * of its own for the call.
 *
 * What a shadow does not close: the region is an ordinary mapping of the
 * caller's process, so a sibling thread that finds it can write it while
 * the driver runs (see docs/architecture.md).
 */
#include <linux/atomic.h>
#include <linux/err.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/moduleparam.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>

#include "vgpu.h"

/* Gauges, read-only module parameters; independent atomics. */
static atomic64_t vgpu_shadow_calls = ATOMIC64_INIT(0);
static atomic64_t vgpu_shadows_live = ATOMIC64_INIT(0);

static int vgpu_gauge_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", (long long)atomic64_read(kp->arg));
}

static const struct kernel_param_ops vgpu_gauge_ops = {
	.get = vgpu_gauge_get,
};

module_param_cb(shadow_calls, &vgpu_gauge_ops, &vgpu_shadow_calls, 0444);
MODULE_PARM_DESC(shadow_calls, "VGPU_RULE_F_SHADOW calls handed to the driver on a shadow (read-only)");
module_param_cb(shadows_live, &vgpu_gauge_ops, &vgpu_shadows_live, 0444);
MODULE_PARM_DESC(shadows_live, "shadow regions mapped now, shadow calls and XFER wrappers (read-only)");

/*
 * The largest shadow: [wrapper | params | pad | buffer | pad | list], whole
 * pages; a nested list is at most VGPU_PARAMS_MAX bytes (filter.c).
 */
#define VGPU_SHADOW_MAX	PAGE_ALIGN(sizeof(struct nv_ioctl_xfer) + \
				   3 * VGPU_PARAMS_MAX + 2 * sizeof(u64))

static unsigned long vgpu_shadow_mmap(size_t len)
{
	return vm_mmap(NULL, 0, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS, 0);
}

/* Forgets the kept region, leaving it mapped. Caller holds sc->lock. */
static void vgpu_shadow_forget(struct vgpu_shadow_cache *sc)
{
	mmdrop(sc->mm);
	sc->mm = NULL;
	sc->base = 0;
	atomic64_dec(&vgpu_shadows_live);
}

/*
 * Takes @ctx's kept region for @sh when it is free and lies in the
 * caller's mm, mapping it on first use. True: @sh holds it (and its lock).
 */
static bool vgpu_shadow_take(struct vgpu_shadow *sh, struct vgpu_ctx *ctx)
{
	struct vgpu_shadow_cache *sc = &ctx->shadow;
	unsigned long base;

	if (!mutex_trylock(&sc->lock))
		return false;
	/* Its process exec'd or exited (the file lives on elsewhere). */
	if (sc->mm && sc->mm != current->mm && !atomic_read(&sc->mm->mm_users))
		vgpu_shadow_forget(sc);
	if (!sc->mm) {
		base = vgpu_shadow_mmap(VGPU_SHADOW_MAX);
		if (!IS_ERR_VALUE(base)) {
			mmgrab(current->mm);
			sc->mm = current->mm;
			sc->base = base;
			atomic64_inc(&vgpu_shadows_live);
		}
	}
	if (sc->mm != current->mm) {
		mutex_unlock(&sc->lock);
		return false;
	}
	sh->cache = sc;
	sh->base = sc->base;
	sh->len = VGPU_SHADOW_MAX;
	return true;
}

/* Maps @len bytes (whole pages) for @sh; 0 or a negative errno. */
static int vgpu_shadow_alloc(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
			     size_t len)
{
	unsigned long base;

	memset(sh, 0, sizeof(*sh));
	if (!current->mm)
		return -EFAULT;
	if (len <= VGPU_SHADOW_MAX && vgpu_shadow_take(sh, ctx))
		return 0;
	base = vgpu_shadow_mmap(len);
	if (IS_ERR_VALUE(base))
		return (int)base;
	sh->base = base;
	sh->len = len;
	atomic64_inc(&vgpu_shadows_live);
	return 0;
}

/*
 * The shadow could not be written: a sibling thread unmapped or protected
 * it. A kept region is forgotten (what lies there now is the caller's), a
 * region of the call's own unmapped.
 */
static void vgpu_shadow_fault(struct vgpu_shadow *sh)
{
	if (sh->cache) {
		vgpu_shadow_forget(sh->cache);
		sh->base = 0;
	}
	vgpu_shadow_unmap(sh);
}

/**
 * vgpu_shadow_map - map a shadow of a call's checked blocks
 * @sh: the shadow, filled here; unmapped by vgpu_shadow_unmap()
 * @ctx: the caller's context, whose kept region is used when free
 * @xfer: the wrapper as the module read it (its @ptr is replaced), or NULL
 * @params: the params as the upcall carried them
 * @plen: their length, 1..VGPU_PARAMS_MAX
 * @ptr_off: offset of the rule's u64 pointer in @params, VGPU_OFF_NONE
 *	when the buffer is not shadowed (@data NULL)
 * @data: the rule's buffer as the upcall carried it, or NULL
 * @dlen: its length, at most VGPU_PARAMS_MAX
 * @list: the buffer's nested list as the upcall carried it, or NULL; needs
 *	@data, and its pointer within @dlen
 *
 * Return: 0, or a negative errno with nothing mapped: -ENOMEM (no room in
 * the caller's address space), -EFAULT (no mm, or the region could not be
 * written: a sibling thread unmapped it).
 */
int vgpu_shadow_map(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
		    const struct nv_ioctl_xfer *xfer,
		    const void *params, u32 plen, u32 ptr_off,
		    const void *data, u32 dlen,
		    const struct vgpu_shadow_list *list)
{
	size_t poff = xfer ? sizeof(*xfer) : 0;
	size_t doff = ALIGN(poff + plen, sizeof(u64));
	size_t loff = ALIGN(doff + dlen, sizeof(u64));
	struct nv_ioctl_xfer wrap;
	unsigned long base;
	size_t end;
	u64 dptr;
	int err;

	if (!plen || plen > VGPU_PARAMS_MAX || dlen > VGPU_PARAMS_MAX ||
	    (data && (ptr_off == VGPU_OFF_NONE || plen < sizeof(u64) ||
		      ptr_off > plen - sizeof(u64))) ||
	    (list && (!data || !list->len || list->len > VGPU_PARAMS_MAX ||
		      dlen < sizeof(u64) ||
		      list->ptr_off > dlen - sizeof(u64)))) {
		memset(sh, 0, sizeof(*sh));
		return -EINVAL;		/* the caller checked: unreachable */
	}
	end = list ? loff + list->len : data ? doff + dlen : poff + plen;
	err = vgpu_shadow_alloc(sh, ctx, PAGE_ALIGN(end));
	if (err)
		return err;
	base = sh->base;
	sh->params = (void __user *)(base + poff);
	sh->data = data ? (void __user *)(base + doff) : NULL;
	sh->list = list ? (void __user *)(base + loff) : NULL;
	sh->arg = xfer ? base : base + poff;

	if (copy_to_user(sh->params, params, plen))
		goto err_unmap;
	if (data) {
		dptr = (u64)(unsigned long)sh->data;
		if (copy_to_user(sh->data, data, dlen) ||
		    copy_to_user(sh->params + ptr_off, &dptr, sizeof(dptr)))
			goto err_unmap;
	}
	if (list) {
		dptr = (u64)(unsigned long)sh->list;
		if (copy_to_user(sh->list, list->list, list->len) ||
		    copy_to_user(sh->data + list->ptr_off, &dptr, sizeof(dptr)))
			goto err_unmap;
	}
	if (xfer) {
		wrap = *xfer;
		wrap.ptr = (u64)(unsigned long)sh->params;
		if (copy_to_user((void __user *)base, &wrap, sizeof(wrap)))
			goto err_unmap;
	}
	atomic64_inc(&vgpu_shadow_calls);
	return 0;

err_unmap:
	vgpu_shadow_fault(sh);
	return -EFAULT;
}

/**
 * vgpu_shadow_map_wrapper - map a copy of an IOCTL_XFER_CMD wrapper
 * @sh: the shadow, filled here (@sh->arg names the copy); unmapped by
 *	vgpu_shadow_unmap()
 * @ctx: the caller's context, whose kept region is used when free
 * @xfer: the wrapper as the module read it, copied as is
 *
 * Return: as vgpu_shadow_map().
 */
int vgpu_shadow_map_wrapper(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
			    const struct nv_ioctl_xfer *xfer)
{
	int err;

	err = vgpu_shadow_alloc(sh, ctx, PAGE_SIZE);
	if (err)
		return err;
	sh->arg = sh->base;
	if (copy_to_user((void __user *)sh->base, xfer, sizeof(*xfer))) {
		vgpu_shadow_fault(sh);
		return -EFAULT;
	}
	return 0;
}

/**
 * vgpu_shadow_read_params - read back the params as the driver left them
 * @sh: a mapped shadow
 * @params: receives @plen bytes
 * @plen: as mapped
 *
 * Return: 0, or -EFAULT when the region could not be read.
 */
int vgpu_shadow_read_params(const struct vgpu_shadow *sh, void *params,
			    u32 plen)
{
	return copy_from_user(params, sh->params, plen) ? -EFAULT : 0;
}

/**
 * vgpu_shadow_read_data - read back the rule's buffer as the driver left it
 * @sh: a mapped shadow with a buffer
 * @data: receives @dlen bytes
 * @dlen: as mapped
 *
 * Return: 0, or -EFAULT when the region could not be read.
 */
int vgpu_shadow_read_data(const struct vgpu_shadow *sh, void *data, u32 dlen)
{
	if (!sh->data)
		return -EFAULT;
	return copy_from_user(data, sh->data, dlen) ? -EFAULT : 0;
}

/**
 * vgpu_shadow_read_list - read back the nested list as the driver left it
 * @sh: a mapped shadow with a list
 * @list: receives @len bytes
 * @len: as mapped
 *
 * Return: 0, or -EFAULT when the region could not be read.
 */
int vgpu_shadow_read_list(const struct vgpu_shadow *sh, void *list, u32 len)
{
	if (!sh->list)
		return -EFAULT;
	return copy_from_user(list, sh->list, len) ? -EFAULT : 0;
}

/* Unmaps the shadow, if mapped (a kept region is given back); safe twice. */
void vgpu_shadow_unmap(struct vgpu_shadow *sh)
{
	if (sh->cache) {
		mutex_unlock(&sh->cache->lock);
		sh->cache = NULL;
		sh->base = 0;
		return;
	}
	if (!sh->base)
		return;
	/*
	 * Fails only when the caller is being killed (its mm goes with it);
	 * a range a sibling thread unmapped in between is no error.
	 */
	if (vm_munmap(sh->base, sh->len))
		pr_debug("vgpu: shadow unmap failed\n");
	sh->base = 0;
	atomic64_dec(&vgpu_shadows_live);
}

/*
 * Release of @ctx (no call is in flight): unmaps its kept region when the
 * caller is in the region's mm; elsewhere (the last reference dropped by
 * another process, or at exit, with no mm) it goes with that mm.
 */
void vgpu_shadow_release(struct vgpu_ctx *ctx)
{
	struct vgpu_shadow_cache *sc = &ctx->shadow;

	if (!sc->mm)
		return;
	if (current->mm == sc->mm && vm_munmap(sc->base, VGPU_SHADOW_MAX))
		pr_debug("vgpu: kept shadow unmap failed\n");
	vgpu_shadow_forget(sc);
}
