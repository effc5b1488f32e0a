// SPDX-License-Identifier: GPL-2.0-only
/*
 * nvsim RM objects: clients, their object trees, GPU memory capacity,
 * controls, and the RM side of CPU mappings.
 *
 * Clients are global (one handle space, like resserv) but usable only
 * through the control file that owns them, or a file registered to it.
 * Every RM call here reports its outcome in the params' status field and
 * returns 0; user pointers inside params give a status when they fault.
 */
#include <linux/bits.h>
#include <linux/capability.h>
#include <linux/log2.h>
#include <linux/file.h>
#include <linux/mm.h>
#include <linux/mutex.h>
#include <linux/sched.h>
#include <linux/sizes.h>
#include <linux/slab.h>
#include <linux/uaccess.h>
#include <linux/xarray.h>

#include "nvsim.h"

/* See nvsim.h: all RM state. */
DEFINE_MUTEX(nvsim_lock);

/* Client handle -> struct nvsim_client; nvsim_lock. */
static DEFINE_XARRAY(nvsim_clients);
/* Next generated client handle, as an offset from the base; nvsim_lock. */
static u32 nvsim_next_client;
/* Clients of all files; nvsim_lock. */
static unsigned int nvsim_nclients;

/* Largest virtual allocation accepted (it charges nothing). */
#define NVSIM_MAX_VIRTUAL	BIT_ULL(50)

/* Most entries of one GET_SURFACE_INFO list (nvsim's bound). */
#define NVSIM_SURFACE_INFO_MAX	16

/*
 * What an allocation asks of its layout: the page size (NVOS32 attr and
 * attr2) and an alignment in bytes (0: none).
 */
struct nvsim_layout {
	u32 attr;
	u32 attr2;
	u64 alignment;
};

union nvsim_alloc_params {
	struct nv0080_alloc_params device;
	struct nv2080_alloc_params subdevice;
	struct nv_memory_allocation_params memory;
	struct nv_vaspace_allocation_params vaspace;
	struct nv_channel_group_allocation_params tsg;
	struct nv00f8_allocation_params fabric;
};

struct nvsim_class {
	u32 hclass;
	enum nvsim_obj_kind kind;
	u32 params_size;	/* 0: parameters are ignored */
	bool params_optional;	/* a NULL pointer accepted */
};

static const struct nvsim_class nvsim_classes[] = {
	{ NV01_ROOT_CLIENT, NVSIM_OBJ_CLIENT, 0, true },
	{ NV01_DEVICE_0, NVSIM_OBJ_DEVICE,
	  sizeof(struct nv0080_alloc_params), false },
	{ NV20_SUBDEVICE_0, NVSIM_OBJ_SUBDEVICE,
	  sizeof(struct nv2080_alloc_params), true },
	{ NV01_MEMORY_LOCAL_USER, NVSIM_OBJ_MEMORY,
	  sizeof(struct nv_memory_allocation_params), false },
	{ NV01_MEMORY_LOCAL_PRIVILEGED, NVSIM_OBJ_MEMORY,
	  sizeof(struct nv_memory_allocation_params), false },
	{ NV50_MEMORY_VIRTUAL, NVSIM_OBJ_VIRTUAL,
	  sizeof(struct nv_memory_allocation_params), false },
	{ FERMI_VASPACE_A, NVSIM_OBJ_VASPACE,
	  sizeof(struct nv_vaspace_allocation_params), true },
	{ KEPLER_CHANNEL_GROUP_A, NVSIM_OBJ_TSG,
	  sizeof(struct nv_channel_group_allocation_params), true },
	{ NV_MEMORY_FABRIC, NVSIM_OBJ_MEMORY,
	  sizeof(struct nv00f8_allocation_params), false },
};

static const struct nvsim_class *nvsim_find_class(u32 hclass)
{
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(nvsim_classes); i++)
		if (nvsim_classes[i].hclass == hclass)
			return &nvsim_classes[i];
	return NULL;
}

/* The file whose clients a call on @nf may use; nvsim_lock. */
static struct nvsim_file *nvsim_owner(struct nvsim_file *nf)
{
	return nf->ctl_file ? nf->ctl_file->private_data : nf;
}

static struct nvsim_client *nvsim_client_get(struct nvsim_file *nf, u32 h)
{
	struct nvsim_client *c = xa_load(&nvsim_clients, h);

	if (!c || c->owner != nvsim_owner(nf))
		return NULL;
	return c;
}

static struct nvsim_obj *nvsim_obj_get(struct nvsim_client *c, u32 h)
{
	return xa_load(&c->objects, h);
}

static bool nvsim_is_gpu_parent(const struct nvsim_obj *o)
{
	return o->kind == NVSIM_OBJ_DEVICE || o->kind == NVSIM_OBJ_SUBDEVICE;
}

static bool nvsim_is_memory(const struct nvsim_obj *o)
{
	return o->kind == NVSIM_OBJ_MEMORY || o->kind == NVSIM_OBJ_VIRTUAL;
}

/*
 * Copies a class's allocation parameters from the pointer NVOS21/NVOS64
 * gives, as serverAllocApiCopyIn and rmapiGetClassAllocParamSize do: the
 * size is the class's, whatever paramsSize says (the driver never reads
 * it; libcuda leaves it 0). A NULL pointer is an invalid argument unless
 * the class's parameters are optional (then they read as zeros), a fault
 * an invalid address. Sets *copied to the bytes to copy back out.
 */
static u32 nvsim_copy_params(u64 uptr, const struct nvsim_class *cls,
			     void *dst, u32 *copied)
{
	*copied = 0;
	if (!cls->params_size)
		return NV_OK;
	if (!uptr) {
		if (!cls->params_optional)
			return NV_ERR_INVALID_ARGUMENT;
		memset(dst, 0, cls->params_size);
		return NV_OK;
	}
	if (copy_from_user(dst, u64_to_user_ptr(uptr), cls->params_size))
		return NV_ERR_INVALID_ADDRESS;
	*copied = cls->params_size;
	return NV_OK;
}

/* A requested handle must be free; 0 asks for a generated one. */
static u32 nvsim_check_handle(struct nvsim_client *c, u32 h)
{
	if (h && xa_load(&c->objects, h))
		return NV_ERR_INSERT_DUPLICATE_NAME;
	if (c->owner->nobjs >= NVSIM_MAX_OBJECTS)
		return NV_ERR_INSUFFICIENT_RESOURCES;
	return NV_OK;
}

static u32 nvsim_gen_handle(struct nvsim_client *c)
{
	u32 h;

	/* At most NVSIM_MAX_OBJECTS are taken, so this ends quickly. */
	do {
		h = NV_UNIQUE_HANDLE_BASE + c->next_handle;
		c->next_handle = (c->next_handle + 1) % NV_UNIQUE_HANDLE_RANGE;
	} while (xa_load(&c->objects, h));
	return h;
}

/* Creates and links an object; the caller checked the handle. */
static u32 nvsim_obj_new(struct nvsim_client *c, struct nvsim_obj *parent,
			 u32 *handle, u32 hclass, enum nvsim_obj_kind kind,
			 struct nvsim_obj **out)
{
	struct nvsim_obj *obj;
	u32 h = *handle ? *handle : nvsim_gen_handle(c);

	obj = kzalloc(sizeof(*obj), GFP_KERNEL);
	if (!obj)
		return NV_ERR_NO_MEMORY;
	if (xa_insert(&c->objects, h, obj, GFP_KERNEL)) {
		kfree(obj);
		return NV_ERR_NO_MEMORY;
	}
	obj->handle = h;
	obj->hclass = hclass;
	obj->kind = kind;
	obj->client = c;
	obj->parent = parent;
	obj->gpu = parent->gpu;
	INIT_LIST_HEAD(&obj->children);
	list_add_tail(&obj->sibling, &parent->children);
	if (nvsim_is_memory(obj))
		INIT_LIST_HEAD(&obj->mem.cpumaps);
	c->owner->nobjs++;
	*handle = h;
	*out = obj;
	return NV_OK;
}

/* Drops one handle's reference; the last returns capacity and pages. */
static void nvsim_mem_put(struct nvsim_mem *m)
{
	if (!m || --m->refs)
		return;
	if (m->charged)
		m->gpu->used -= m->size;
	if (m->store)
		nvsim_store_put(m->store);
	kfree(m);
}

/* Frees @obj and, first, everything under it; returns their capacity. */
static void nvsim_obj_free(struct nvsim_obj *obj)
{
	struct nvsim_client *c = obj->client;
	struct nvsim_obj *child, *tmp;
	struct nvsim_cpumap *map, *mtmp;

	list_for_each_entry_safe(child, tmp, &obj->children, sibling)
		nvsim_obj_free(child);

	xa_erase(&c->objects, obj->handle);
	c->owner->nobjs--;

	if (obj->kind == NVSIM_OBJ_TSG)
		nvsim_group_remove(&obj->tsg);
	if (nvsim_is_memory(obj)) {
		list_for_each_entry_safe(map, mtmp, &obj->mem.cpumaps, node) {
			list_del(&map->node);
			kfree(map);
			c->owner->nobjs--;
		}
		nvsim_mem_put(obj->mem.m);
	}

	if (obj->kind != NVSIM_OBJ_CLIENT) {
		list_del(&obj->sibling);
		kfree(obj);
		return;
	}
	xa_erase(&nvsim_clients, c->root.handle);
	nvsim_nclients--;
	list_del(&c->owner_node);
	xa_destroy(&c->objects);
	kfree(c);
}

void nvsim_file_free_clients(struct nvsim_file *nf)
{
	struct nvsim_client *c, *tmp;

	lockdep_assert_held(&nvsim_lock);
	list_for_each_entry_safe(c, tmp, &nf->clients, owner_node)
		nvsim_obj_free(&c->root);
}

static u32 nvsim_client_alloc(struct nvsim_file *nf, u32 *handle)
{
	struct nvsim_file *owner = nvsim_owner(nf);
	struct nvsim_client *c;
	u32 h = *handle;

	if (h && xa_load(&nvsim_clients, h))
		return NV_ERR_INSERT_DUPLICATE_NAME;
	if (owner->nobjs >= NVSIM_MAX_OBJECTS ||
	    nvsim_nclients >= NVSIM_MAX_CLIENTS)
		return NV_ERR_INSUFFICIENT_RESOURCES;
	/* Fewer clients than handles, so this ends. */
	while (!h) {
		h = NV_CLIENT_HANDLE_BASE + nvsim_next_client;
		nvsim_next_client = (nvsim_next_client + 1) % NV_CLIENT_HANDLE_MAX;
		if (xa_load(&nvsim_clients, h))
			h = 0;
	}

	c = kzalloc(sizeof(*c), GFP_KERNEL);
	if (!c)
		return NV_ERR_NO_MEMORY;
	xa_init(&c->objects);
	c->owner = owner;
	c->tgid = task_tgid_nr(current);
	c->root.handle = h;
	c->root.hclass = NV01_ROOT_CLIENT;
	c->root.kind = NVSIM_OBJ_CLIENT;
	c->root.client = c;
	INIT_LIST_HEAD(&c->root.children);
	if (xa_insert(&c->objects, h, &c->root, GFP_KERNEL))
		goto err_free;
	if (xa_insert(&nvsim_clients, h, c, GFP_KERNEL))
		goto err_objects;
	list_add_tail(&c->owner_node, &owner->clients);
	owner->nobjs++;
	nvsim_nclients++;
	*handle = h;
	return NV_OK;

err_objects:
	xa_destroy(&c->objects);
err_free:
	kfree(c);
	return NV_ERR_NO_MEMORY;
}

/*
 * The granule an allocation's size rounds up to, as the driver's heap
 * does: the page size chosen by NVOS32_ATTR_PAGE_SIZE (DEFAULT and 4KB:
 * 4 KiB; BIG: 64 KiB; HUGE: 2 MiB, or 512 MiB with
 * NVOS32_ATTR2_PAGE_SIZE_HUGE_512MB; 256 GiB pages are not supported
 * here), or the alignment asked for when larger (a power of two).
 */
static u32 nvsim_granule(const struct nvsim_layout *l, u64 *granule,
			 u64 *page)
{
	u32 ps = (l->attr >> NVOS32_ATTR_PAGE_SIZE_SHIFT) &
		 NVOS32_ATTR_PAGE_SIZE_MASK;
	u32 huge = (l->attr2 >> NVOS32_ATTR2_PAGE_SIZE_HUGE_SHIFT) &
		   NVOS32_ATTR2_PAGE_SIZE_HUGE_MASK;

	switch (ps) {
	case NVOS32_ATTR_PAGE_SIZE_BIG:
		*page = SZ_64K;
		break;
	case NVOS32_ATTR_PAGE_SIZE_HUGE:
		if (huge == NVOS32_ATTR2_PAGE_SIZE_HUGE_256GB)
			return NV_ERR_NOT_SUPPORTED;
		*page = huge == NVOS32_ATTR2_PAGE_SIZE_HUGE_512MB ? SZ_512M :
			SZ_2M;
		break;
	default:
		*page = SZ_4K;
		break;
	}
	if (l->alignment && (!is_power_of_2(l->alignment) ||
			     l->alignment > NVSIM_MAX_VIRTUAL))
		return NV_ERR_INVALID_ARGUMENT;
	*granule = max_t(u64, *page, l->alignment);
	return NV_OK;
}

/*
 * Memory objects: local memory (charged against the GPU), system memory
 * (not charged; RM_ALLOC_MEMORY only) and virtual ranges (not charged).
 * Sizes round up to the page size and alignment of @l (nvsim_granule),
 * and what is charged is the rounded size; *size and *offset return what
 * was given, as the driver reports them.
 */
static u32 nvsim_mem_alloc(struct nvsim_client *c, struct nvsim_obj *parent,
			   u32 *handle, u32 hclass, const struct nvsim_layout *l,
			   u64 *size, u64 *offset, struct nvsim_obj **out)
{
	u64 granule, page;

	bool virt = hclass == NV50_MEMORY_VIRTUAL;
	bool charged = hclass == NV01_MEMORY_LOCAL_USER ||
		       hclass == NV01_MEMORY_LOCAL_PRIVILEGED ||
		       hclass == NV_MEMORY_FABRIC;
	struct nvsim_gpu *gpu;
	struct nvsim_obj *obj;
	struct nvsim_mem *m;
	u64 sz = *size;
	u32 st;

	if (!nvsim_is_gpu_parent(parent))
		return NV_ERR_INVALID_OBJECT_PARENT;
	st = nvsim_check_handle(c, *handle);
	if (st)
		return st;
	gpu = parent->gpu;
	if (!sz)
		return NV_ERR_INVALID_ARGUMENT;
	st = nvsim_granule(l, &granule, &page);
	if (st)
		return st;
	if (virt) {
		if (sz > NVSIM_MAX_VIRTUAL)
			return NV_ERR_INVALID_LIMIT;
	} else if (sz > gpu->capacity) {
		return NV_ERR_NO_MEMORY;
	}
	/* Both bounds are far below 2^64 - granule: no overflow. */
	sz = round_up(sz, granule);
	if (!virt && sz > gpu->capacity)
		return NV_ERR_NO_MEMORY;
	if (charged && sz > gpu->capacity - gpu->used)
		return NV_ERR_NO_MEMORY;

	m = kzalloc(sizeof(*m), GFP_KERNEL);
	if (!m)
		return NV_ERR_NO_MEMORY;
	st = nvsim_obj_new(c, parent, handle, hclass,
			   virt ? NVSIM_OBJ_VIRTUAL : NVSIM_OBJ_MEMORY, &obj);
	if (st) {
		kfree(m);
		return st;
	}
	m->refs = 1;
	m->gpu = gpu;
	m->size = sz;
	m->page_size = page;
	m->charged = charged;
	if (!virt) {
		m->fb_offset = round_up(gpu->next_fb, granule);
		gpu->next_fb = m->fb_offset + sz;
	}
	if (charged)
		gpu->used += sz;
	obj->mem.m = m;
	*size = sz;
	*offset = m->fb_offset;
	if (out)
		*out = obj;
	return NV_OK;
}

/*
 * NV_MEMORY_FABRIC under a subdevice: a flexible fabric object (no hVidMem)
 * takes alloc_size of video memory in pages of page_size (2 MiB, 512 MiB or
 * 256 GiB), charged to the GPU like local memory; a sticky one maps memory
 * the caller already holds (hVidMem) and takes nothing new.
 */
static u32 nvsim_fabric_alloc(struct nvsim_client *c, struct nvsim_obj *parent,
			      u32 *handle, struct nv00f8_allocation_params *f)
{
	u64 page = f->page_size, size, offset;
	struct nvsim_layout l = {};	/* rounded to the fabric page below */
	struct nvsim_obj *mem;

	if (parent->kind != NVSIM_OBJ_SUBDEVICE)
		return NV_ERR_INVALID_OBJECT_PARENT;
	if (page != NV_MEMORY_FABRIC_PAGE_SIZE_2M &&
	    page != NV_MEMORY_FABRIC_PAGE_SIZE_512M &&
	    page != NV_MEMORY_FABRIC_PAGE_SIZE_256G)
		return NV_ERR_INVALID_ARGUMENT;
	if (!f->alloc_size || f->alloc_size > parent->gpu->capacity)
		return NV_ERR_INVALID_ARGUMENT;
	if (f->map_h_vid_mem) {
		mem = nvsim_obj_get(c, f->map_h_vid_mem);
		if (!mem || mem->kind != NVSIM_OBJ_MEMORY ||
		    mem->gpu != parent->gpu)
			return NV_ERR_INVALID_OBJECT_HANDLE;
		return NV_ERR_NOT_SUPPORTED;	/* sticky mappings: not simulated */
	}
	size = round_up(f->alloc_size, page);
	return nvsim_mem_alloc(c, parent, handle, NV_MEMORY_FABRIC, &l, &size,
			       &offset, NULL);
}

static u32 nvsim_alloc_locked(struct nvsim_file *nf, u32 hroot, u32 hparent,
			      u32 *handle, const struct nvsim_class *cls,
			      union nvsim_alloc_params *prm)
{
	struct nvsim_client *c;
	struct nvsim_obj *parent, *obj;
	struct nvsim_layout l;
	u32 st;

	if (cls->kind == NVSIM_OBJ_CLIENT)
		return nvsim_client_alloc(nf, handle);

	c = nvsim_client_get(nf, hroot);
	if (!c)
		return NV_ERR_INVALID_CLIENT;
	parent = nvsim_obj_get(c, hparent);
	if (!parent)
		return NV_ERR_INVALID_OBJECT_PARENT;

	if (cls->hclass == NV_MEMORY_FABRIC)
		return nvsim_fabric_alloc(c, parent, handle, &prm->fabric);

	switch (cls->kind) {
	case NVSIM_OBJ_MEMORY:
	case NVSIM_OBJ_VIRTUAL:
		l = (struct nvsim_layout) {
			.attr = prm->memory.attr,
			.attr2 = prm->memory.attr2,
			.alignment = prm->memory.alignment,
		};
		st = nvsim_mem_alloc(c, parent, handle, cls->hclass, &l,
				     &prm->memory.size, &prm->memory.offset,
				     NULL);
		if (!st)
			prm->memory.limit = prm->memory.size - 1;
		return st;
	case NVSIM_OBJ_DEVICE:
		if (parent->kind != NVSIM_OBJ_CLIENT)
			return NV_ERR_INVALID_OBJECT_PARENT;
		st = nvsim_check_handle(c, *handle);
		if (st)
			return st;
		if (prm->device.device_id >= NV_MAX_DEVICES)
			return NV_ERR_INVALID_ARGUMENT;
		if (prm->device.device_id >= nvsim_ngpus)
			return NV_ERR_INVALID_STATE;
		st = nvsim_obj_new(c, parent, handle, cls->hclass, cls->kind,
				   &obj);
		if (!st)
			obj->gpu = &nvsim_gpus[prm->device.device_id];
		return st;
	case NVSIM_OBJ_SUBDEVICE:
		if (parent->kind != NVSIM_OBJ_DEVICE)
			return NV_ERR_INVALID_OBJECT_PARENT;
		st = nvsim_check_handle(c, *handle);
		if (st)
			return st;
		if (prm->subdevice.sub_device_id != 0)
			return NV_ERR_INVALID_ARGUMENT;
		return nvsim_obj_new(c, parent, handle, cls->hclass, cls->kind,
				     &obj);
	case NVSIM_OBJ_VASPACE:
	case NVSIM_OBJ_TSG:
		if (parent->kind != NVSIM_OBJ_DEVICE)
			return NV_ERR_INVALID_OBJECT_PARENT;
		st = nvsim_check_handle(c, *handle);
		if (st)
			return st;
		st = nvsim_obj_new(c, parent, handle, cls->hclass, cls->kind,
				   &obj);
		/* A new channel group is scheduled on, as the driver's. */
		if (!st && cls->kind == NVSIM_OBJ_TSG)
			nvsim_group_add(&obj->tsg, obj->gpu, c->root.handle,
					*handle, c->owner->tgid);
		return st;
	default:
		return NV_ERR_INVALID_CLASS;
	}
}

/* NV_ESC_RM_ALLOC: NVOS21 (32 B) or NVOS64 (48 B). */
int nvsim_rm_alloc(struct nvsim_file *nf, void *buf, u32 size)
{
	struct nvos21 *p = buf;
	struct nvos64 *p64 = buf;
	bool access = size == sizeof(*p64);
	u32 *status = access ? &p64->status : &p->status;
	const struct nvsim_class *cls;
	union nvsim_alloc_params prm;
	u32 st, psize;

	/* Userspace root allocations become NV01_ROOT_CLIENT. */
	if (p->h_class == NV01_ROOT || p->h_class == NV01_ROOT_NON_PRIV)
		p->h_class = NV01_ROOT_CLIENT;

	cls = nvsim_find_class(p->h_class);
	if (!cls) {
		*status = NV_ERR_INVALID_CLASS;
		return 0;
	}
	st = nvsim_copy_params(p->p_alloc_parms, cls, &prm, &psize);
	if (st) {
		*status = st;
		return 0;
	}

	mutex_lock(&nvsim_lock);
	st = nvsim_alloc_locked(nf, p->h_root, p->h_object_parent,
				&p->h_object_new, cls, &prm);
	mutex_unlock(&nvsim_lock);

	/* Output fields of the class parameters (memory size/offset/limit). */
	if (!st && psize &&
	    copy_to_user(u64_to_user_ptr(p->p_alloc_parms), &prm, psize))
		pr_debug("nvsim: alloc params copy-out failed\n");
	*status = st;
	return 0;
}

/* NV_ESC_RM_FREE: frees the object and its subtree (a client: all of it). */
int nvsim_rm_free(struct nvsim_file *nf, struct nvos00 *p)
{
	struct nvsim_client *c;
	struct nvsim_obj *obj;

	mutex_lock(&nvsim_lock);
	c = nvsim_client_get(nf, p->h_root);
	if (!c) {
		p->status = NV_ERR_INVALID_CLIENT;
	} else {
		obj = nvsim_obj_get(c, p->h_object_old);
		if (!obj) {
			p->status = NV_ERR_INVALID_OBJECT_HANDLE;
		} else {
			nvsim_obj_free(obj);
			p->status = NV_OK;
		}
	}
	mutex_unlock(&nvsim_lock);
	return 0;
}

/*
 * NV_ESC_RM_DUP_OBJECT of a memory object: a new handle hObject (0: a
 * generated one, returned) under hParent of client hClient, for the memory
 * of hObjectSrc in client hClientSrc.  Both clients must be usable through
 * this file; the parent must be a device or subdevice of the memory's GPU.
 * The handles share the memory: capacity is charged once, the pages are
 * the same, and the memory goes when the last handle is freed.  Other
 * objects are NV_ERR_NOT_SUPPORTED here (the real RM dups most classes).
 */
static u32 nvsim_dup_locked(struct nvsim_file *nf, struct nvos55 *p)
{
	struct nvsim_client *c, *src_c;
	struct nvsim_obj *parent, *src, *obj;
	u32 h = p->h_object;
	u32 st;

	if (p->flags & ~NV04_DUP_HANDLE_FLAGS_REJECT_KERNEL_DUP_PRIVILEGE)
		return NV_ERR_INVALID_FLAGS;
	c = nvsim_client_get(nf, p->h_client);
	src_c = nvsim_client_get(nf, p->h_client_src);
	if (!c || !src_c)
		return NV_ERR_INVALID_CLIENT;
	src = nvsim_obj_get(src_c, p->h_object_src);
	if (!src)
		return NV_ERR_INVALID_OBJECT_HANDLE;
	if (!nvsim_is_memory(src))
		return NV_ERR_NOT_SUPPORTED;
	parent = nvsim_obj_get(c, p->h_parent);
	if (!parent || !nvsim_is_gpu_parent(parent))
		return NV_ERR_INVALID_OBJECT_PARENT;
	if (parent->gpu != src->gpu)
		return NV_ERR_INVALID_ARGUMENT;
	st = nvsim_check_handle(c, h);
	if (st)
		return st;
	st = nvsim_obj_new(c, parent, &h, src->hclass, src->kind, &obj);
	if (st)
		return st;
	obj->mem.m = src->mem.m;
	obj->mem.m->refs++;
	p->h_object = h;
	return NV_OK;
}

int nvsim_rm_dup_object(struct nvsim_file *nf, struct nvos55 *p)
{
	mutex_lock(&nvsim_lock);
	p->status = nvsim_dup_locked(nf, p);
	mutex_unlock(&nvsim_lock);
	return 0;
}

/*
 * NVSIM_ESC_SUBMIT_WORK: queues simulated work on a channel group of a
 * client usable through this file (engine.c runs it).  reserved must be 0.
 */
static u32 nvsim_submit_locked(struct nvsim_file *nf, struct nvsim_submit_work *p)
{
	struct nvsim_client *c;
	struct nvsim_obj *obj;

	if (p->reserved)
		return NV_ERR_INVALID_ARGUMENT;
	c = nvsim_client_get(nf, p->h_client);
	if (!c)
		return NV_ERR_INVALID_CLIENT;
	obj = nvsim_obj_get(c, p->h_channel_group);
	if (!obj || obj->kind != NVSIM_OBJ_TSG)
		return NV_ERR_INVALID_OBJECT_HANDLE;
	return nvsim_group_submit(&obj->tsg, p->work_ns);
}

int nvsim_submit_work(struct nvsim_file *nf, struct nvsim_submit_work *p)
{
	mutex_lock(&nvsim_lock);
	p->status = nvsim_submit_locked(nf, p);
	mutex_unlock(&nvsim_lock);
	return 0;
}

/* ---- controls ---- */

struct nvsim_ctrl {
	u32 cmd;
	enum nvsim_obj_kind kind;	/* class the control is exported on */
	u32 size;
	u32 list_max;	/* params begin {u32 n; u32 pad; u64 list}: max n */
};

/* A control of NVSIM_OBJ_MEMORY is exported on every memory class. */
static bool nvsim_ctrl_on(const struct nvsim_ctrl *ctrl,
			  const struct nvsim_obj *obj)
{
	if (ctrl->kind == NVSIM_OBJ_MEMORY)
		return nvsim_is_memory(obj);
	return ctrl->kind == obj->kind;
}

static const struct nvsim_ctrl nvsim_ctrls[] = {
	{ NV2080_CTRL_CMD_FB_GET_INFO, NVSIM_OBJ_SUBDEVICE,
	  sizeof(struct nv2080_fb_get_info_params),
	  NV2080_CTRL_FB_INFO_MAX_LIST_SIZE },
	{ NV2080_CTRL_CMD_FB_GET_INFO_V2, NVSIM_OBJ_SUBDEVICE,
	  sizeof(struct nv2080_fb_get_info_v2_params) },
	{ NVA06C_CTRL_CMD_GPFIFO_SCHEDULE, NVSIM_OBJ_TSG,
	  sizeof(struct nva06c_gpfifo_schedule_params) },
	{ NVA06C_CTRL_CMD_SET_TIMESLICE, NVSIM_OBJ_TSG,
	  sizeof(struct nva06c_timeslice_params) },
	{ NVA06C_CTRL_CMD_GET_TIMESLICE, NVSIM_OBJ_TSG,
	  sizeof(struct nva06c_timeslice_params) },
	{ NVA06C_CTRL_CMD_PREEMPT, NVSIM_OBJ_TSG,
	  sizeof(struct nva06c_preempt_params) },
	{ NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL, NVSIM_OBJ_TSG,
	  sizeof(struct nva06c_interleave_level_params) },
	{ NVSIM_CTRL_CMD_GET_WORK_STATS, NVSIM_OBJ_TSG,
	  sizeof(struct nvsim_work_stats_params) },
	{ NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO, NVSIM_OBJ_CLIENT,
	  sizeof(struct nv0000_client_get_handle_info_params) },
	{ NV0041_CTRL_CMD_GET_SURFACE_INFO, NVSIM_OBJ_MEMORY,
	  sizeof(struct nv0041_get_surface_info_params),
	  NVSIM_SURFACE_INFO_MAX },
};

/*
 * CLIENT_GET_HANDLE_INFO on a client: the parent's handle (0 for the
 * client itself) or the class of one of its objects.
 */
static u32 nvsim_handle_info(struct nvsim_obj *client,
			     struct nv0000_client_get_handle_info_params *p)
{
	struct nvsim_obj *obj = nvsim_obj_get(client->client, p->h_object);

	if (!obj)
		return NV_ERR_INVALID_OBJECT_HANDLE;
	switch (p->index) {
	case NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_PARENT:
		p->data.i_result = 0;
		p->data.h_result = obj->parent ? obj->parent->handle : 0;
		return NV_OK;
	case NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO_INDEX_CLASSID:
		p->data.i_result = obj->hclass;
		return NV_OK;
	default:
		return NV_ERR_INVALID_ARGUMENT;
	}
}

/* GET_SURFACE_INFO: PHYS_SIZE is the size allocated, in 4 KiB units. */
static u32 nvsim_surface_info(const struct nvsim_obj *obj,
			      struct nv0041_surface_info *list, u32 n)
{
	const struct nvsim_mem *m = obj->mem.m;
	u32 i;

	for (i = 0; i < n; i++) {
		switch (list[i].index) {
		case NV0041_CTRL_SURFACE_INFO_INDEX_ATTRS:
		case NV0041_CTRL_SURFACE_INFO_INDEX_COMPR_COVERAGE:
			list[i].data = 0;
			break;
		case NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_SIZE:
			list[i].data = m->size /
				NV0041_CTRL_SURFACE_INFO_PHYS_SIZE_SCALE_FACTOR;
			break;
		case NV0041_CTRL_SURFACE_INFO_INDEX_PHYS_ATTR:
			list[i].data = (m->page_size >= SZ_2M ?
					NVOS32_ATTR_PAGE_SIZE_HUGE :
					m->page_size >= SZ_64K ?
					NVOS32_ATTR_PAGE_SIZE_BIG :
					NVOS32_ATTR_PAGE_SIZE_4KB) <<
				       NVOS32_ATTR_PAGE_SIZE_SHIFT;
			break;
		case NV0041_CTRL_SURFACE_INFO_INDEX_ADDR_SPACE_TYPE:
			list[i].data = m->charged ?
				NV0000_CTRL_CMD_CLIENT_GET_ADDR_SPACE_TYPE_VIDMEM :
				NV0000_CTRL_CMD_CLIENT_GET_ADDR_SPACE_TYPE_SYSMEM;
			break;
		default:
			return NV_ERR_INVALID_ARGUMENT;
		}
	}
	return NV_OK;
}

static u32 nvsim_ctrl_target(struct nvsim_file *nf, const struct nvos54 *p,
			     struct nvsim_obj **out)
{
	struct nvsim_client *c = nvsim_client_get(nf, p->h_client);

	if (!c)
		return NV_ERR_INVALID_CLIENT;
	*out = nvsim_obj_get(c, p->h_object);
	return *out ? NV_OK : NV_ERR_INVALID_OBJECT_HANDLE;
}

/* FB info in KiB from the GPU's capacity and usage; nvsim_lock. */
static u32 nvsim_fb_info(const struct nvsim_gpu *gpu, struct nv2080_fb_info *list,
			 u32 n)
{
	u32 i;

	if (!n || n > NV2080_CTRL_FB_INFO_MAX_LIST_SIZE)
		return NV_ERR_INVALID_ARGUMENT;
	for (i = 0; i < n; i++) {
		switch (list[i].index) {
		case NV2080_CTRL_FB_INFO_INDEX_RAM_SIZE:
		case NV2080_CTRL_FB_INFO_INDEX_TOTAL_RAM_SIZE:
		case NV2080_CTRL_FB_INFO_INDEX_HEAP_SIZE:
		case NV2080_CTRL_FB_INFO_INDEX_USABLE_RAM_SIZE:
			list[i].data = gpu->capacity >> 10;
			break;
		case NV2080_CTRL_FB_INFO_INDEX_HEAP_FREE:
			list[i].data = (gpu->capacity - gpu->used) >> 10;
			break;
		default:
			if (list[i].index > NV2080_CTRL_FB_INFO_INDEX_MAX)
				return NV_ERR_INVALID_ARGUMENT;
			list[i].data = 0;
			break;
		}
	}
	return NV_OK;
}

static u32 nvsim_ctrl_run(struct nvsim_obj *obj, u32 cmd, void *prm,
			  struct nv2080_fb_info *list)
{
	struct nv2080_fb_get_info_params *fb = prm;
	struct nv2080_fb_get_info_v2_params *fb2 = prm;
	struct nva06c_gpfifo_schedule_params *sched = prm;
	struct nva06c_timeslice_params *ts = prm;
	struct nva06c_interleave_level_params *level = prm;

	switch (cmd) {
	case NV2080_CTRL_CMD_FB_GET_INFO:
		return nvsim_fb_info(obj->gpu, list, fb->list_size);
	case NV2080_CTRL_CMD_FB_GET_INFO_V2:
		return nvsim_fb_info(obj->gpu, fb2->list, fb2->list_size);
	case NVA06C_CTRL_CMD_GPFIFO_SCHEDULE:
		nvsim_group_set_enabled(&obj->tsg, !!sched->b_enable);
		return NV_OK;
	case NVA06C_CTRL_CMD_SET_TIMESLICE:
		return nvsim_group_set_timeslice(&obj->tsg, ts->timeslice_us);
	case NVA06C_CTRL_CMD_PREEMPT:
		return nvsim_group_preempt(&obj->tsg, prm);
	case NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL:
		/*
		 * RS_ACCESS_NICE, checked at each call: CAP_SYS_NICE of the
		 * caller (os_check_access).  The other grant, a client made
		 * by an administrator, is not modelled.
		 */
		if (!capable(CAP_SYS_NICE))
			return NV_ERR_INSUFFICIENT_PERMISSIONS;
		return nvsim_group_set_level(&obj->tsg,
					     level->tsg_interleave_level);
	case NVA06C_CTRL_CMD_GET_TIMESLICE:
		ts->timeslice_us = nvsim_group_timeslice(&obj->tsg);
		return NV_OK;
	case NVSIM_CTRL_CMD_GET_WORK_STATS:
		nvsim_group_stats(&obj->tsg, prm);
		return NV_OK;
	case NV0000_CTRL_CMD_CLIENT_GET_HANDLE_INFO:
		return nvsim_handle_info(obj, prm);
	case NV0041_CTRL_CMD_GET_SURFACE_INFO:
		return nvsim_surface_info(obj, (void *)list, fb->list_size);
	default:
		return NV_ERR_NOT_SUPPORTED;
	}
}

static const struct nvsim_ctrl *nvsim_find_ctrl(u32 cmd)
{
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(nvsim_ctrls); i++)
		if (nvsim_ctrls[i].cmd == cmd)
			return &nvsim_ctrls[i];
	return NULL;
}

/*
 * NV_ESC_RM_CONTROL.  Order of checks: params pointer/size pairing, client,
 * object, command exported on the object's class (else NOT_SUPPORTED),
 * exact params size (else INVALID_PARAM_STRUCT), copy-in.  The params are
 * copied outside nvsim_lock and the target looked up again under it.
 */
static u32 nvsim_control(struct nvsim_file *nf, struct nvos54 *p)
{
	const struct nvsim_ctrl *ctrl = nvsim_find_ctrl(p->cmd);
	struct nv2080_fb_info *list = NULL;
	struct nv2080_fb_get_info_params *fb;
	struct nvsim_obj *obj;
	void *prm;
	u32 st;

	if (!!p->params_size != !!p->params)
		return NV_ERR_INVALID_ARGUMENT;

	mutex_lock(&nvsim_lock);
	st = nvsim_ctrl_target(nf, p, &obj);
	if (!st && (!ctrl || !nvsim_ctrl_on(ctrl, obj)))
		st = NV_ERR_NOT_SUPPORTED;
	mutex_unlock(&nvsim_lock);
	if (st)
		return st;
	if (p->params_size != ctrl->size)
		return NV_ERR_INVALID_PARAM_STRUCT;

	prm = kmalloc(ctrl->size, GFP_KERNEL);
	if (!prm)
		return NV_ERR_NO_MEMORY;
	if (copy_from_user(prm, u64_to_user_ptr(p->params), ctrl->size)) {
		st = NV_ERR_INVALID_ADDRESS;
		goto out;
	}

	/*
	 * FB_GET_INFO and GET_SURFACE_INFO point at their lists of
	 * {index, data}: copy that in too.
	 */
	BUILD_BUG_ON(sizeof(struct nv0041_get_surface_info_params) !=
		     sizeof(*fb));
	BUILD_BUG_ON(sizeof(struct nv0041_surface_info) != sizeof(*list));
	fb = prm;
	if (ctrl->list_max) {
		if (!fb->list_size || fb->list_size > ctrl->list_max ||
		    !fb->list) {
			st = NV_ERR_INVALID_ARGUMENT;
			goto out;
		}
		list = kmalloc_array(fb->list_size, sizeof(*list), GFP_KERNEL);
		if (!list) {
			st = NV_ERR_NO_MEMORY;
			goto out;
		}
		if (copy_from_user(list, u64_to_user_ptr(fb->list),
				   fb->list_size * sizeof(*list))) {
			st = NV_ERR_INVALID_ADDRESS;
			goto out;
		}
	}

	mutex_lock(&nvsim_lock);
	st = nvsim_ctrl_target(nf, p, &obj);
	if (!st && !nvsim_ctrl_on(ctrl, obj))
		st = NV_ERR_NOT_SUPPORTED;
	if (!st)
		st = nvsim_ctrl_run(obj, p->cmd, prm, list);
	mutex_unlock(&nvsim_lock);

	if (!st && list &&
	    copy_to_user(u64_to_user_ptr(fb->list), list,
			 fb->list_size * sizeof(*list)))
		st = NV_ERR_INVALID_ADDRESS;
	if (!st && copy_to_user(u64_to_user_ptr(p->params), prm, ctrl->size))
		st = NV_ERR_INVALID_ADDRESS;
out:
	kfree(list);
	kfree(prm);
	return st;
}

int nvsim_rm_control(struct nvsim_file *nf, struct nvos54 *p)
{
	p->status = nvsim_control(nf, p);
	return 0;
}

/* ---- other memory paths ---- */

/*
 * NV_ESC_RM_ALLOC_MEMORY (nvidiaN only): classes NV01_MEMORY_SYSTEM (not
 * charged) and NV01_MEMORY_LOCAL_USER/PRIVILEGED (charged); size is
 * limit + 1; pMemory returns the object's BAR1 address.  The fd field is
 * not used (nvsim maps all memory through nvidiaN).
 */
int nvsim_rm_alloc_memory(struct nvsim_file *nf, struct nvos02_with_fd *p)
{
	const struct nvsim_layout l = {};	/* 4 KiB pages */
	struct nvsim_client *c;
	struct nvsim_obj *parent, *obj;
	u64 size, offset;
	u32 st;

	if (p->h_class != NV01_MEMORY_SYSTEM &&
	    p->h_class != NV01_MEMORY_LOCAL_USER &&
	    p->h_class != NV01_MEMORY_LOCAL_PRIVILEGED) {
		p->status = NV_ERR_INVALID_CLASS;
		return 0;
	}
	if (p->limit == U64_MAX) {
		p->status = NV_ERR_INVALID_LIMIT;
		return 0;
	}
	size = p->limit + 1;

	mutex_lock(&nvsim_lock);
	c = nvsim_client_get(nf, p->h_root);
	if (!c) {
		st = NV_ERR_INVALID_CLIENT;
		goto out;
	}
	parent = nvsim_obj_get(c, p->h_object_parent);
	if (!parent) {
		st = NV_ERR_INVALID_OBJECT_PARENT;
		goto out;
	}
	st = nvsim_mem_alloc(c, parent, &p->h_object_new, p->h_class, &l,
			     &size, &offset, &obj);
	if (!st) {
		p->limit = size - 1;
		p->p_memory = nvsim_bar1_base(obj->gpu) + offset;
	}
out:
	mutex_unlock(&nvsim_lock);
	p->status = st;
	return 0;
}

/*
 * What the three allocating NVOS32 functions hand the common construct
 * (RM turns each into NV_MEMORY_ALLOCATION_PARAMS): their data union
 * members differ in layout, not in meaning.
 */
struct nvsim_heap_alloc {
	u32 flags;
	u32 *h_memory;
	u64 *size;
	u64 *offset;
	u64 *limit;
	u32 *partition_stride;
	u64 range_lo;
	u64 range_hi;
	struct nvsim_layout layout;
};

/*
 * The range an allocation must fit in, as RM's heap reads it: 0..0 is the
 * whole heap, an end past the heap is clamped to it, a begin past the end
 * is an invalid argument, and a size the window cannot hold is out of
 * memory.  nvsim does not place objects inside the heap (its FB offsets
 * are its own), so the window bounds what fits, not where.
 */
static u32 nvsim_heap_range(const struct nvsim_gpu *gpu, u64 lo, u64 hi,
			    u64 size)
{
	u64 top = gpu->capacity - 1;

	if (!lo && !hi)
		hi = top;
	hi = min(hi, top);
	if (lo > hi)
		return NV_ERR_INVALID_ARGUMENT;
	if (size && (size > hi - lo + 1 || PAGE_ALIGN(size) > hi - lo + 1))
		return NV_ERR_NO_MEMORY;
	return NV_OK;
}

static u32 nvsim_heap_alloc(struct nvsim_client *c, struct nvsim_obj *parent,
			    const struct nvsim_heap_alloc *r)
{
	bool provided = r->flags & NVOS32_ALLOC_FLAGS_MEMORY_HANDLE_PROVIDED;
	bool virt = r->flags & NVOS32_ALLOC_FLAGS_VIRTUAL;
	struct nvsim_obj *obj;
	u32 h = provided ? *r->h_memory : 0;
	u32 st;

	*r->partition_stride = 256;
	if (!h && provided)
		return NV_ERR_INVALID_ARGUMENT;
	/* RM checks the range of a virtual allocation when it maps it. */
	if (!virt) {
		st = nvsim_heap_range(parent->gpu, r->range_lo, r->range_hi,
				      *r->size);
		if (st)
			return st;
	}
	st = nvsim_mem_alloc(c, parent, &h,
			     virt ? NV50_MEMORY_VIRTUAL : NV01_MEMORY_LOCAL_USER,
			     &r->layout, r->size, r->offset, &obj);
	if (st)
		return st;
	*r->h_memory = h;
	*r->limit = *r->offset + *r->size - 1;
	return NV_OK;
}

/* ALLOC_SIZE and ALLOC_TILED_PITCH_HEIGHT take the range only on request. */
static void nvsim_heap_range_opt(struct nvsim_heap_alloc *r, u64 lo, u64 hi)
{
	if (r->flags & NVOS32_ALLOC_FLAGS_USE_BEGIN_END) {
		r->range_lo = lo;
		r->range_hi = hi;
	}
}

static u32 nvsim_alloc_size(struct nvsim_client *c, struct nvsim_obj *parent,
			    struct nvos32_alloc_size *a)
{
	struct nvsim_heap_alloc r = {
		.flags = a->flags, .h_memory = &a->h_memory, .size = &a->size,
		.offset = &a->offset, .limit = &a->limit,
		.partition_stride = &a->partition_stride,
		.layout = { a->attr, a->attr2, a->alignment },
	};

	nvsim_heap_range_opt(&r, a->range_begin, a->range_end);
	return nvsim_heap_alloc(c, parent, &r);
}

/* The size is height x pitch, pitch signed, as RM computes it (mod 2^64). */
static u32 nvsim_alloc_tiled(struct nvsim_client *c, struct nvsim_obj *parent,
			     struct nvos32_alloc_tiled_pitch_height *a)
{
	struct nvsim_heap_alloc r = {
		.flags = a->flags, .h_memory = &a->h_memory, .size = &a->size,
		.offset = &a->offset, .limit = &a->limit,
		.partition_stride = &a->partition_stride,
		.layout = { a->attr, a->attr2, a->alignment },
	};

	a->size = (u64)a->height * (u64)(s64)a->pitch;
	nvsim_heap_range_opt(&r, a->range_begin, a->range_end);
	return nvsim_heap_alloc(c, parent, &r);
}

static u32 nvsim_alloc_range(struct nvsim_client *c, struct nvsim_obj *parent,
			     struct nvos32_alloc_size_range *a)
{
	struct nvsim_heap_alloc r = {
		.flags = a->flags, .h_memory = &a->h_memory, .size = &a->size,
		.offset = &a->offset, .limit = &a->limit,
		.partition_stride = &a->partition_stride,
		.range_lo = a->range_begin, .range_hi = a->range_end,
		.layout = { a->attr, a->attr2, a->alignment },
	};

	return nvsim_heap_alloc(c, parent, &r);
}

static u32 nvsim_vid_heap_locked(struct nvsim_file *nf, struct nvos32 *p)
{
	struct nvsim_client *c;
	struct nvsim_obj *parent, *obj;
	struct nvsim_gpu *gpu;
	u32 st = NV_OK;

	c = nvsim_client_get(nf, p->h_root);
	if (!c)
		return NV_ERR_INVALID_CLIENT;
	parent = nvsim_obj_get(c, p->h_object_parent);
	if (!parent || !nvsim_is_gpu_parent(parent))
		return NV_ERR_INVALID_OBJECT_PARENT;
	gpu = parent->gpu;

	switch (p->function) {
	case NVOS32_FUNCTION_ALLOC_SIZE:
		st = nvsim_alloc_size(c, parent, &p->data.alloc_size);
		break;
	case NVOS32_FUNCTION_ALLOC_TILED_PITCH_HEIGHT:
		st = nvsim_alloc_tiled(c, parent, &p->data.alloc_tiled);
		break;
	case NVOS32_FUNCTION_ALLOC_SIZE_RANGE:
		st = nvsim_alloc_range(c, parent, &p->data.alloc_range);
		break;
	case NVOS32_FUNCTION_FREE:
		if (!(p->data.free.flags & NVOS32_FREE_FLAGS_MEMORY_HANDLE_PROVIDED))
			return NV_ERR_INVALID_FLAGS;
		obj = nvsim_obj_get(c, p->data.free.h_memory);
		if (!obj || !nvsim_is_memory(obj))
			return NV_ERR_INVALID_OBJECT_HANDLE;
		nvsim_obj_free(obj);
		break;
	case NVOS32_FUNCTION_INFO:
		p->data.info.offset = 0;
		p->data.info.size = gpu->capacity - gpu->used;
		p->data.info.base = 0;
		break;
	default:
		return NV_ERR_INVALID_ARGUMENT;
	}
	p->total = gpu->capacity;
	p->free = gpu->capacity - gpu->used;
	return st;
}

/*
 * NV_ESC_RM_VID_HEAP_CONTROL: ALLOC_SIZE, ALLOC_TILED_PITCH_HEIGHT and
 * ALLOC_SIZE_RANGE (a memory object under the device, its size, offset
 * and limit reported back; NVOS32_ALLOC_FLAGS_VIRTUAL makes an uncharged
 * virtual one), FREE (by handle) and INFO; total/free report the GPU's
 * heap.  As RmDeprecatedVidHeapControl: an IVC heap number is not
 * supported and a function it has no handler for is an invalid argument
 * (nvsim serves only these five).
 */
int nvsim_rm_vid_heap(struct nvsim_file *nf, struct nvos32 *p)
{
	if (p->ivc_heap_number > 0) {
		p->status = NV_ERR_NOT_SUPPORTED;
		return 0;
	}
	mutex_lock(&nvsim_lock);
	p->status = nvsim_vid_heap_locked(nf, p);
	mutex_unlock(&nvsim_lock);
	return 0;
}

/* ---- CPU mappings ---- */

/*
 * The client, device (or the client itself) and memory object that
 * RM_MAP_MEMORY and RM_UNMAP_MEMORY name. Caller holds nvsim_lock.
 */
static u32 nvsim_map_target(struct nvsim_file *nf, u32 hclient, u32 hdevice,
			    u32 hmemory, struct nvsim_client **c,
			    struct nvsim_obj **dev, struct nvsim_obj **mem)
{
	*c = nvsim_client_get(nf, hclient);
	if (!*c)
		return NV_ERR_INVALID_CLIENT;
	*dev = nvsim_obj_get(*c, hdevice);
	if (!*dev || ((*dev)->kind != NVSIM_OBJ_CLIENT &&
		      !nvsim_is_gpu_parent(*dev)))
		return NV_ERR_INVALID_OBJECT_HANDLE;
	*mem = nvsim_obj_get(*c, hmemory);
	if (!*mem || !nvsim_is_memory(*mem))
		return NV_ERR_INVALID_OBJECT_HANDLE;
	return NV_OK;
}

static u32 nvsim_map_locked(struct nvsim_file *nf, struct nvos33_with_fd *p,
			    struct nvsim_file *gf)
{
	struct nvsim_client *c;
	struct nvsim_obj *dev, *mem;
	struct nvsim_mapctx *ctx;
	struct nvsim_cpumap *map;
	u64 start, end;
	u32 st;

	st = nvsim_map_target(nf, p->h_client, p->h_device, p->h_memory, &c,
			      &dev, &mem);
	if (st)
		return st;
	if (mem->kind == NVSIM_OBJ_VIRTUAL)
		return NV_ERR_INVALID_ARGUMENT;
	if (dev->gpu && dev->gpu != mem->gpu)
		return NV_ERR_INVALID_ARGUMENT;
	if (!p->length || p->offset >= mem->mem.m->size ||
	    p->length > mem->mem.m->size - p->offset)
		return NV_ERR_INVALID_LIMIT;
	if (c->tgid != task_tgid_nr(current))
		return NV_ERR_INVALID_CLIENT;
	if (c->owner->nobjs >= NVSIM_MAX_OBJECTS)
		return NV_ERR_INSUFFICIENT_RESOURCES;

	/*
	 * rm_create_mmap_context: the fd must be a GPU file of the driver
	 * (nv_get_file_private without ctl), of that GPU.
	 */
	if (!gf)
		return NV_ERR_INVALID_ARGUMENT;
	if (gf->kind != NVSIM_FILE_GPU || gf->gpu != mem->gpu)
		return NV_ERR_INVALID_ARGUMENT;
	if (gf->mapctx)
		return NV_ERR_STATE_IN_USE;

	if (!mem->mem.m->store) {
		mem->mem.m->store = nvsim_store_create(mem->mem.m->size >> PAGE_SHIFT);
		if (!mem->mem.m->store)
			return NV_ERR_NO_MEMORY;
	}
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	map = kzalloc(sizeof(*map), GFP_KERNEL);
	if (!ctx || !map) {
		kfree(ctx);
		kfree(map);
		return NV_ERR_NO_MEMORY;
	}
	start = round_down(p->offset, PAGE_SIZE);
	end = round_up(p->offset + p->length, PAGE_SIZE);
	nvsim_store_get(mem->mem.m->store);
	ctx->store = mem->mem.m->store;
	ctx->first_page = start >> PAGE_SHIFT;
	ctx->npages = (end - start) >> PAGE_SHIFT;
	gf->mapctx = ctx;

	map->address = nvsim_bar1_base(mem->gpu) + mem->mem.m->fb_offset + p->offset;
	list_add_tail(&map->node, &mem->mem.cpumaps);
	c->owner->nobjs++;
	p->p_linear_address = map->address;
	return NV_OK;
}

/*
 * NV_ESC_RM_MAP_MEMORY (on nvidiactl): validates the mapping, returns its
 * BAR1 address in pLinearAddress and leaves a mapping context on the
 * nvidiaN file named by fd (one per file, as nvlfp: a second map through
 * the same file is NV_ERR_STATE_IN_USE).  mmap(fd, offset 0, the mapped
 * length rounded to pages) then maps the memory object's pages.
 */
int nvsim_rm_map_memory(struct nvsim_file *nf, struct nvos33_with_fd *p)
{
	struct nvsim_file *gf = NULL;
	struct file *gfile = nvsim_file_get(p->fd, false, &gf);

	mutex_lock(&nvsim_lock);
	p->status = nvsim_map_locked(nf, p, gf);
	mutex_unlock(&nvsim_lock);
	if (gfile)
		fput(gfile);
	return 0;
}

static u32 nvsim_unmap_locked(struct nvsim_file *nf, struct nvos34 *p)
{
	struct nvsim_client *c;
	struct nvsim_obj *dev, *mem;
	struct nvsim_cpumap *map;
	u32 st;

	st = nvsim_map_target(nf, p->h_client, p->h_device, p->h_memory, &c,
			      &dev, &mem);
	if (st)
		return st;
	list_for_each_entry(map, &mem->mem.cpumaps, node) {
		if (map->address == p->p_linear_address) {
			list_del(&map->node);
			kfree(map);
			c->owner->nobjs--;
			return NV_OK;
		}
	}
	return NV_ERR_INVALID_ARGUMENT;
}

/*
 * NV_ESC_RM_UNMAP_MEMORY: forgets the RM mapping record; pages already
 * mmapped stay valid until munmap (the VMA holds the backing store).
 */
int nvsim_rm_unmap_memory(struct nvsim_file *nf, struct nvos34 *p)
{
	mutex_lock(&nvsim_lock);
	p->status = nvsim_unmap_locked(nf, p);
	mutex_unlock(&nvsim_lock);
	return 0;
}
