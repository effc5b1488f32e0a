// SPDX-License-Identifier: GPL-2.0
/*
 * Shadows: what the driver reads is what the module read, not the caller's
 * memory again. The driver reads user memory of the current process only,
 * so the copy goes into a region mapped in the caller's mm for the
 * duration of the call.
 *
 * Shadow calls (VGPU_RULE_F_SHADOW) hand the driver the blocks the daemon
 * checked:
 *
 *   [ xfer wrapper (XFER calls) | params | the rule's buffer | its list ]
 *
 * The params are written as the upcall carried them, except that the
 * rule's pointer names the shadow's copy of its buffer, and the buffer's
 * pointer to its nested list (VGPU_A_NESTED) names the shadow's copy of the
 * list; an XFER wrapper of our own names the shadow params. The driver is
 * called on the shadow and its results are read back.
 *
 * Every other IOCTL_XFER_CMD call gets a wrapper-only shadow: the wrapper
 * as the module read it (its escape chose the filter's path), still naming
 * the caller's params.
 *
 * Every other call the module read to match it against the filter (no
 * rule's key matched, a rule without the flag, the fail-open policy) runs
 * on a shadow of its params as read, too (slowpath.c).
 *
 * The region is guarded: the caller's threads share its mm, so an ordinary
 * mapping there could be rewritten between the module's copy and the
 * driver's read. A region is pages of the module's (vmalloc_user) behind a
 * file of its own (fdxlate.c's pseudo filesystem), mapped shared. The
 * module writes and reads them through its kernel mapping only. The user
 * mapping's pages are read-only until written (write-notify): a write
 * fault is granted only to the thread whose call is in the driver, while
 * it is there (struct vgpu_region.writer), so only the driver's own
 * results make a page writable, and RM writes its results after it read
 * its params. Every other writer gets SIGBUS (or EFAULT in the kernel).
 * After the call the pages written are write-protected again (folio_mkclean,
 * as fb_defio does): their PTEs stay, read-only, so the next call's reads
 * do not fault. VM_IO keeps get_user_pages
 * off the region, so /proc/<pid>/mem, process_vm_writev, io_uring and
 * O_DIRECT can neither write nor pin it; VM_DONTCOPY keeps it from
 * children; splitting and moving it are refused.
 *
 * What the guard cannot stop is munmap: a sibling that unmaps the whole
 * region while the driver runs can put memory of its own at the address
 * the driver reads. Every unmap is seen (vm_ops->close); one during a call
 * revokes the context (every later call -EIO). See docs/architecture.md.
 *
 * Each open file keeps one region mapped between its calls (struct
 * vgpu_shadow_cache), in the mm of the process that first used it: a call
 * that finds it free reuses it, so that the common call pays two copies
 * and no mmap or munmap. A call that finds it busy (a sibling thread's
 * call in flight) or comes from another mm maps a region of its own for
 * the call.
 */
#include <linux/atomic.h>
#include <linux/err.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/moduleparam.h>
#include <linux/pagemap.h>
#include <linux/rmap.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>
#include <linux/slab.h>
#include <linux/sysfs.h>
#include <linux/vmalloc.h>

#include "compat.h"

#include "vgpu.h"

/* Gauges, read-only module parameters; independent atomics. */
static atomic64_t vgpu_shadow_calls = ATOMIC64_INIT(0);
static atomic64_t vgpu_shadows_live = ATOMIC64_INIT(0);
static atomic64_t vgpu_shadow_refused = ATOMIC64_INIT(0);
static atomic64_t vgpu_shadow_revoked = ATOMIC64_INIT(0);

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
module_param_cb(shadow_writes_refused, &vgpu_gauge_ops, &vgpu_shadow_refused, 0444);
MODULE_PARM_DESC(shadow_writes_refused, "writes to a shadow by anyone but the driver's caller, refused (read-only)");
module_param_cb(shadow_revoked, &vgpu_gauge_ops, &vgpu_shadow_revoked, 0444);
MODULE_PARM_DESC(shadow_revoked, "contexts revoked: their shadow was unmapped during a call (read-only)");

/**
 * struct vgpu_region - the pages behind a shadow; its file's private_data
 * @kbuf: vmalloc_user() pages, @len bytes; each page's ->mapping is the
 *	file's, as the fault path wants of a shared file page
 * @len: whole pages
 * @writer: the task whose call is in the driver on this region, or NULL.
 *	Written by that task alone (enter, leave); read by page_mkwrite in
 *	any faulting task, where only the writer itself can compare equal:
 *	no lock, READ_ONCE/WRITE_ONCE
 * @granted: pages (a bit per page offset) a write fault was granted on
 *	since they were last write-protected; the writer's own, like @writer
 * @closes: VMAs of the region closed (unmapped, or a refused move undone);
 *	a region once closed is never used again
 *
 * Lives as long as its file: one reference per VMA, one of the module's.
 */
struct vgpu_region {
	void *kbuf;
	size_t len;
	struct task_struct *writer;
	unsigned long granted;
	atomic_t closes;
};

static vm_fault_t vgpu_region_fault(struct vm_fault *vmf)
{
	struct vgpu_region *r = vmf->vma->vm_file->private_data;
	struct page *page;

	if (vmf->pgoff >= r->len >> PAGE_SHIFT)
		return VM_FAULT_SIGBUS;
	page = vmalloc_to_page(r->kbuf + (vmf->pgoff << PAGE_SHIFT));
	get_page(page);
	vmf->page = page;
	return 0;
}

/* Only the driver, in the call of the region's writer, makes a page writable. */
static vm_fault_t vgpu_region_mkwrite(struct vm_fault *vmf)
{
	struct vgpu_region *r = vmf->vma->vm_file->private_data;

	if (READ_ONCE(r->writer) != current) {
		atomic64_inc(&vgpu_shadow_refused);
		return VM_FAULT_SIGBUS;
	}
	r->granted |= BIT(vmf->pgoff);	/* < len pages: the fault checked */
	return 0;
}

static void vgpu_region_close(struct vm_area_struct *vma)
{
	struct vgpu_region *r = vma->vm_file->private_data;

	atomic_inc(&r->closes);
}

/* A part would be a second VMA whose close leaves the first in place. */
static int vgpu_region_may_split(struct vm_area_struct *vma,
				 unsigned long addr)
{
	return -EINVAL;
}

static int vgpu_region_mremap(struct vm_area_struct *vma)
{
	return -EINVAL;
}

static const struct vm_operations_struct vgpu_region_vm_ops = {
	.fault		= vgpu_region_fault,
	.page_mkwrite	= vgpu_region_mkwrite,
	.close		= vgpu_region_close,
	.may_split	= vgpu_region_may_split,
	.mremap		= vgpu_region_mremap,
};

/* Once, by the module's vm_mmap(): shared, whole, never copied or grown. */
static int vgpu_region_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct vgpu_region *r = file->private_data;

	if (!(vma->vm_flags & VM_SHARED) || vma->vm_pgoff ||
	    vma->vm_end - vma->vm_start != r->len)
		return -EINVAL;
	vgpu_vm_flags_set(vma, VM_IO | VM_DONTCOPY | VM_DONTEXPAND | VM_DONTDUMP);
	vma->vm_ops = &vgpu_region_vm_ops;
	return 0;
}

/* The last reference: no VMA maps the pages any more. */
static int vgpu_region_release(struct inode *inode, struct file *file)
{
	struct vgpu_region *r = file->private_data;
	size_t off;

	for (off = 0; off < r->len; off += PAGE_SIZE)
		vmalloc_to_page(r->kbuf + off)->mapping = NULL;
	vfree(r->kbuf);
	kfree(r);
	return 0;
}

static const struct file_operations vgpu_region_fops = {
	.owner		= THIS_MODULE,
	.mmap		= vgpu_region_mmap,
	.release	= vgpu_region_release,
};

/* A region of @len bytes, mapped in the caller's mm; 0 or a negative errno. */
static int vgpu_region_map(size_t len, struct file **filep,
			   unsigned long *basep)
{
	struct vgpu_region *r;
	unsigned long base;
	struct file *f;
	size_t off;
	int err = -ENOMEM;

	r = kzalloc(sizeof(*r), GFP_KERNEL_ACCOUNT);
	if (!r)
		return -ENOMEM;
	r->len = len;
	r->kbuf = vmalloc_user(len);
	if (!r->kbuf)
		goto err_free;
	f = vgpu_pseudo_file("vgpu-shadow", &vgpu_region_fops, r);
	if (IS_ERR(f)) {
		err = PTR_ERR(f);
		goto err_vfree;
	}
	for (off = 0; off < len; off += PAGE_SIZE) {
		struct page *page = vmalloc_to_page(r->kbuf + off);

		page->mapping = f->f_mapping;
		page->index = off >> PAGE_SHIFT;
	}
	/* From here on the file owns @r: its release frees it. */
	base = vm_mmap(f, 0, len, PROT_READ | PROT_WRITE, MAP_SHARED, 0);
	if (IS_ERR_VALUE(base)) {
		fput(f);
		return (int)base;
	}
	*filep = f;
	*basep = base;
	atomic64_inc(&vgpu_shadows_live);
	return 0;

err_vfree:
	vfree(r->kbuf);
err_free:
	kfree(r);
	return err;
}

static struct vgpu_region *vgpu_region_of(struct file *f)
{
	return f->private_data;
}

/* Still mapped as the module mapped it: no VMA of it was ever closed. */
static bool vgpu_region_intact(struct file *f)
{
	return !atomic_read(&vgpu_region_of(f)->closes);
}

/*
 * Lets go of a region: unmapped when it still lies at @base in the
 * caller's mm (what lies there after a close is the caller's own), then
 * the module's reference dropped.
 */
static void vgpu_region_put(struct file *f, unsigned long base,
			    struct mm_struct *mm)
{
	if (mm == current->mm && vgpu_region_intact(f) &&
	    vm_munmap(base, vgpu_region_of(f)->len))
		pr_debug("vgpu: shadow unmap failed\n");
	fput(f);
	atomic64_dec(&vgpu_shadows_live);
}

/*
 * The largest shadow: [wrapper | params | pad | buffer | pad | list], whole
 * pages; a nested list is at most VGPU_PARAMS_MAX bytes (filter.c).
 */
#define VGPU_SHADOW_MAX	PAGE_ALIGN(sizeof(struct nv_ioctl_xfer) + \
				   3 * VGPU_PARAMS_MAX + 2 * sizeof(u64))

/* Forgets the kept region. Caller holds sc->lock. */
static void vgpu_shadow_forget(struct vgpu_shadow_cache *sc)
{
	vgpu_region_put(sc->file, sc->base, sc->mm);
	mmdrop(sc->mm);
	sc->mm = NULL;
	sc->base = 0;
	sc->file = NULL;
}

/*
 * Takes @ctx's kept region for @sh when it is free and lies in the
 * caller's mm, mapping it on first use. True: @sh holds it (and its lock).
 */
static bool vgpu_shadow_take(struct vgpu_shadow *sh, struct vgpu_ctx *ctx)
{
	struct vgpu_shadow_cache *sc = &ctx->shadow;

	if (!mutex_trylock(&sc->lock))
		return false;
	/* Its process exec'd or exited (the file lives on elsewhere). */
	if (sc->mm && sc->mm != current->mm && !atomic_read(&sc->mm->mm_users))
		vgpu_shadow_forget(sc);
	/* Unmapped by the caller between calls: what lies there is its own. */
	if (sc->mm == current->mm && !vgpu_region_intact(sc->file))
		vgpu_shadow_forget(sc);
	if (!sc->mm && !vgpu_region_map(VGPU_SHADOW_MAX, &sc->file, &sc->base)) {
		mmgrab(current->mm);
		sc->mm = current->mm;
	}
	if (sc->mm != current->mm) {
		mutex_unlock(&sc->lock);
		return false;
	}
	sh->cache = sc;
	sh->file = sc->file;
	sh->base = sc->base;
	sh->len = VGPU_SHADOW_MAX;
	return true;
}

/* Maps @len bytes (whole pages) for @sh; 0 or a negative errno. */
static int vgpu_shadow_alloc(struct vgpu_shadow *sh, struct vgpu_ctx *ctx,
			     size_t len)
{
	int err;

	/* struct vgpu_region.granted has a bit for each page. */
	BUILD_BUG_ON(VGPU_SHADOW_MAX / PAGE_SIZE > BITS_PER_LONG);
	memset(sh, 0, sizeof(*sh));
	if (len > VGPU_SHADOW_MAX)
		return -EINVAL;
	if (!current->mm)
		return -EFAULT;
	if (vgpu_shadow_take(sh, ctx))
		return 0;
	err = vgpu_region_map(len, &sh->file, &sh->base);
	if (err)
		return err;
	sh->len = len;
	return 0;
}

/* The kernel's view of the user address @u in @sh's region. */
static void *vgpu_shadow_kaddr(const struct vgpu_shadow *sh, void __user *u)
{
	return vgpu_region_of(sh->file)->kbuf +
	       ((unsigned long)u - sh->base);
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
 * the caller's address space, or no memory), -EFAULT (no mm).
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
	sh->kparams = vgpu_shadow_kaddr(sh, sh->params);

	memcpy(sh->kparams, params, plen);
	if (data) {
		sh->kdata = vgpu_shadow_kaddr(sh, sh->data);
		dptr = (u64)(unsigned long)sh->data;
		memcpy(sh->kdata, data, dlen);
		put_unaligned(dptr, (u64 *)(sh->kparams + ptr_off));
	}
	if (list) {
		sh->klist = vgpu_shadow_kaddr(sh, sh->list);
		dptr = (u64)(unsigned long)sh->list;
		memcpy(sh->klist, list->list, list->len);
		put_unaligned(dptr, (u64 *)(sh->kdata + list->ptr_off));
	}
	if (xfer) {
		wrap = *xfer;
		wrap.ptr = (u64)(unsigned long)sh->params;
		memcpy(vgpu_shadow_kaddr(sh, (void __user *)base), &wrap,
		       sizeof(wrap));
	}
	atomic64_inc(&vgpu_shadow_calls);
	return 0;
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
	memcpy(vgpu_shadow_kaddr(sh, (void __user *)sh->base), xfer,
	       sizeof(*xfer));
	return 0;
}

/**
 * vgpu_shadow_enter - the driver is about to run on @sh
 * @sh: a mapped shadow, or NULL
 *
 * From here to vgpu_shadow_leave() the caller's thread, and it alone, may
 * make a page of the region writable: the driver writing its results.
 */
void vgpu_shadow_enter(struct vgpu_shadow *sh)
{
	if (sh && sh->file)
		WRITE_ONCE(vgpu_region_of(sh->file)->writer, current);
}

/**
 * vgpu_shadow_leave - the driver has returned
 * @sh: as given to vgpu_shadow_enter()
 *
 * Writes are refused again, and every page the driver made writable is
 * write-protected in the caller's mm (a TLB flush of its pages).
 *
 * Return: false when the region was unmapped during the call (or before
 * it, since it was checked): the driver may then have read whatever the
 * caller put at the region's address. True otherwise, and without @sh.
 */
bool vgpu_shadow_leave(struct vgpu_shadow *sh)
{
	struct vgpu_region *r;
	unsigned int i;

	if (!sh || !sh->file)
		return true;
	r = vgpu_region_of(sh->file);
	WRITE_ONCE(r->writer, NULL);
	for_each_set_bit(i, &r->granted, BITS_PER_LONG) {
		struct page *page = vmalloc_to_page(r->kbuf + i * PAGE_SIZE);

		lock_page(page);
		folio_mkclean(page_folio(page));
		unlock_page(page);
	}
	r->granted = 0;
	if (vgpu_region_intact(sh->file))
		return true;
	atomic64_inc(&vgpu_shadow_revoked);
	return false;
}

/* Lets go of the shadow, if mapped (a kept region is given back); safe twice. */
void vgpu_shadow_unmap(struct vgpu_shadow *sh)
{
	if (sh->cache) {
		mutex_unlock(&sh->cache->lock);
		sh->cache = NULL;
	} else if (sh->file) {
		vgpu_region_put(sh->file, sh->base, current->mm);
	}
	sh->file = NULL;
	sh->base = 0;
}

/*
 * Release of @ctx (no call is in flight): unmaps its kept region when the
 * caller is in the region's mm; elsewhere (the last reference dropped by
 * another process, or at exit, with no mm) it goes with that mm.
 */
void vgpu_shadow_release(struct vgpu_ctx *ctx)
{
	struct vgpu_shadow_cache *sc = &ctx->shadow;

	if (sc->mm)
		vgpu_shadow_forget(sc);
}
