// SPDX-License-Identifier: GPL-2.0-only
/*
 * nvsim CPU mappings of simulated GPU memory.
 *
 * A memory object gets a backing store at its first RM_MAP_MEMORY.  The
 * store's pages are real, allocated zeroed on first fault, so every
 * mapping of the same object (through any nvidiaN file, by any process)
 * sees the same bytes.  The store is reference counted: the memory
 * object, each mapping context and each VMA hold a reference, so pages
 * stay valid while mapped even after the object is freed.
 *
 * Real pages are bounded by the module parameter backing_mib; a fault
 * beyond it is SIGBUS.
 */
#include <linux/atomic.h>
#include <linux/gfp.h>
#include <linux/kref.h>
#include <linux/mm.h>
#include <linux/module.h>
#include <linux/slab.h>
#include <linux/xarray.h>

#include "compat.h"
#include "nvsim.h"

static unsigned int backing_mib = 256;
module_param(backing_mib, uint, 0444);
MODULE_PARM_DESC(backing_mib, "Real memory for mapped pages, all GPUs (MiB, default 256)");

/* Pages allocated for all stores; bounded by backing_mib. */
static atomic_long_t nvsim_backing_pages;

struct nvsim_store {
	struct kref ref;
	pgoff_t npages;
	struct xarray pages;	/* page index -> struct page; xa_lock */
};

int nvsim_store_init(void)
{
	atomic_long_set(&nvsim_backing_pages, 0);
	return 0;
}

void nvsim_store_exit(void)
{
	long left = atomic_long_read(&nvsim_backing_pages);

	if (left)
		pr_err("nvsim: %ld backing pages leaked\n", left);
}

struct nvsim_store *nvsim_store_create(pgoff_t npages)
{
	struct nvsim_store *store = kzalloc(sizeof(*store), GFP_KERNEL);

	if (!store)
		return NULL;
	kref_init(&store->ref);
	store->npages = npages;
	xa_init(&store->pages);
	return store;
}

void nvsim_store_get(struct nvsim_store *store)
{
	kref_get(&store->ref);
}

static void nvsim_store_release(struct kref *ref)
{
	struct nvsim_store *store = container_of(ref, struct nvsim_store, ref);
	struct page *page;
	unsigned long idx;
	long n = 0;

	xa_for_each(&store->pages, idx, page) {
		put_page(page);
		n++;
	}
	xa_destroy(&store->pages);
	atomic_long_sub(n, &nvsim_backing_pages);
	kfree(store);
}

void nvsim_store_put(struct nvsim_store *store)
{
	kref_put(&store->ref, nvsim_store_release);
}

void nvsim_mapctx_free(struct nvsim_mapctx *ctx)
{
	nvsim_store_put(ctx->store);
	kfree(ctx);
}

static struct page *nvsim_store_page(struct nvsim_store *store, pgoff_t idx)
{
	long limit = (long)backing_mib << (20 - PAGE_SHIFT);
	struct page *page, *old;

	page = xa_load(&store->pages, idx);
	if (page)
		return page;

	if (atomic_long_inc_return(&nvsim_backing_pages) > limit) {
		atomic_long_dec(&nvsim_backing_pages);
		return ERR_PTR(-ENOSPC);
	}
	page = alloc_page(GFP_HIGHUSER | __GFP_ZERO);
	if (!page) {
		atomic_long_dec(&nvsim_backing_pages);
		return ERR_PTR(-ENOMEM);
	}
	old = xa_cmpxchg(&store->pages, idx, NULL, page, GFP_KERNEL);
	if (old) {
		/* Lost a race (or xa error): use the winner's page. */
		put_page(page);
		atomic_long_dec(&nvsim_backing_pages);
		if (xa_is_err(old))
			return ERR_PTR(xa_err(old));
		return old;
	}
	return page;
}

/* vm_pgoff was set to the first store page, so vmf->pgoff indexes it. */
static vm_fault_t nvsim_vm_fault(struct vm_fault *vmf)
{
	struct nvsim_store *store = vmf->vma->vm_private_data;
	struct page *page;

	if (vmf->pgoff >= store->npages)
		return VM_FAULT_SIGBUS;
	page = nvsim_store_page(store, vmf->pgoff);
	if (IS_ERR(page))
		return PTR_ERR(page) == -ENOMEM ? VM_FAULT_OOM : VM_FAULT_SIGBUS;
	get_page(page);
	vmf->page = page;
	return 0;
}

/* A VMA copy (fork, split) takes its own store reference. */
static void nvsim_vm_open(struct vm_area_struct *vma)
{
	nvsim_store_get(vma->vm_private_data);
}

static void nvsim_vm_close(struct vm_area_struct *vma)
{
	nvsim_store_put(vma->vm_private_data);
}

static const struct vm_operations_struct nvsim_vm_ops = {
	.open = nvsim_vm_open,
	.close = nvsim_vm_close,
	.fault = nvsim_vm_fault,
};

/*
 * mmap of nvidia-uvm: a simple stand-in for UVM's managed ranges (not
 * UVM's semantics).  Each mapping gets pages of its own, zeroed on first
 * touch and shared only with its copies (fork); it must be MAP_SHARED
 * (else -EINVAL) and no longer than backing_mib (else -ENOMEM).  Faults
 * beyond backing_mib for all stores are SIGBUS, as for GPU memory.  The
 * offset is ignored: UVM asks for offset == address, nvsim does not check.
 */
static int nvsim_uvm_mmap(struct vm_area_struct *vma)
{
	unsigned long limit = (unsigned long)backing_mib << (20 - PAGE_SHIFT);
	unsigned long npages = vma_pages(vma);
	struct nvsim_store *store;

	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;
	if (npages > limit)
		return -ENOMEM;
	store = nvsim_store_create(npages);
	if (!store)
		return -ENOMEM;
	vma->vm_pgoff = 0;
	vma->vm_private_data = store;
	vma->vm_ops = &nvsim_vm_ops;
	nvsim_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	return 0;
}

/*
 * mmap of nvidiaN, as nvidia_mmap_helper(): the file needs a mapping
 * context from RM_MAP_MEMORY (else -EINVAL), the offset must be 0 (else
 * -EINVAL) and the length the mapped length rounded to pages (else
 * -ENXIO).  Mappings must be MAP_SHARED (else -EINVAL).  nvidia-uvm maps
 * anonymous-like pages (nvsim_uvm_mmap()); nvidiactl cannot be mapped
 * (-ENODEV).
 */
int nvsim_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct nvsim_file *nf = file->private_data;
	struct nvsim_store *store = NULL;
	unsigned long npages = vma_pages(vma);
	pgoff_t first = 0;
	int ret = 0;

	if (nf->kind == NVSIM_FILE_UVM)
		return nvsim_uvm_mmap(vma);
	if (nf->kind != NVSIM_FILE_GPU)
		return -ENODEV;
	if (!(vma->vm_flags & VM_SHARED))
		return -EINVAL;

	mutex_lock(&nvsim_lock);
	if (!nf->mapctx || vma->vm_pgoff != 0) {
		ret = -EINVAL;
	} else if (npages != nf->mapctx->npages) {
		ret = -ENXIO;
	} else {
		store = nf->mapctx->store;
		first = nf->mapctx->first_page;
		nvsim_store_get(store);
	}
	mutex_unlock(&nvsim_lock);
	if (ret)
		return ret;

	vma->vm_pgoff = first;
	vma->vm_private_data = store;
	vma->vm_ops = &nvsim_vm_ops;
	nvsim_vm_flags_set(vma, VM_DONTEXPAND | VM_DONTDUMP);
	return 0;
}
