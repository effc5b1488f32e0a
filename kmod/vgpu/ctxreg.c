// SPDX-License-Identifier: GPL-2.0
/*
 * The registry of live contexts, keyed by ctx id: what LIST_CONTEXTS reports
 * and where SCHEDULE finds a context's backing file.
 *
 * Rules:
 * - A context is in vgpu_ctxs from the end of a successful open to the start
 *   of its release. Writers (xa_insert, xa_erase) serialize on the xarray's
 *   own lock, xa_lock(&vgpu_ctxs).
 * - Release erases the context before it drops ctx->backing, and frees the
 *   context with kfree_rcu: a reader under rcu_read_lock() may read the
 *   immutable fields of a context it found, even one being released.
 * - A reader that needs the backing file takes its reference under
 *   xa_lock(&vgpu_ctxs): while the context is still in the array under that
 *   lock, release has not reached its fput, so the file's count is nonzero
 *   and get_file() is safe. The caller then owns a reference that outlives
 *   the context; it drops it with fput().
 */
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/rcupdate.h>
#include <linux/xarray.h>

#include "vgpu.h"

/* struct vgpu_ctx by ctx id; xa_lock guards writes and backing lookups. */
static DEFINE_XARRAY(vgpu_ctxs);

/* Publishes @ctx, fully set up; called at the end of open. */
int vgpu_ctx_register(struct vgpu_ctx *ctx)
{
	unsigned long index = ctx->id;

	/* Ids come from a 64-bit counter; an index is a long. */
	if (index != ctx->id)
		return -EOVERFLOW;
	return xa_insert(&vgpu_ctxs, index, ctx, GFP_KERNEL);
}

/* Withdraws @ctx; called first in release, before ctx->backing is put. */
void vgpu_ctx_unregister(struct vgpu_ctx *ctx)
{
	xa_erase(&vgpu_ctxs, (unsigned long)ctx->id);
}

/**
 * vgpu_ctx_backing_get - a reference on the backing file of a live context
 * @id: the ctx id
 * @node: out: the context's enum vgpu_node
 *
 * Return: the file, referenced (the caller fputs it), or NULL when no
 * context @id is open.
 */
struct file *vgpu_ctx_backing_get(u64 id, u32 *node)
{
	struct file *backing = NULL;
	struct vgpu_ctx *ctx;

	if ((unsigned long)id != id)
		return NULL;
	xa_lock(&vgpu_ctxs);
	ctx = xa_load(&vgpu_ctxs, id);
	if (ctx) {
		backing = get_file(ctx->backing);
		*node = ctx->node->kind;
	}
	xa_unlock(&vgpu_ctxs);
	return backing;
}

/**
 * vgpu_ctx_list - live contexts from a ctx id on, in ascending order
 * @start: the first ctx id wanted
 * @out: room for @max entries
 * @max: most entries to fill
 * @next: out: the ctx id to ask for next, 0 when no context is left
 *
 * Return: the number of entries filled.
 */
u32 vgpu_ctx_list(u64 start, struct vgpu_context *out,
		  struct vgpu_opener *openers, u32 max, u64 *next)
{
	struct vgpu_ctx *ctx;
	unsigned long index;
	u32 n = 0;

	*next = 0;
	if ((unsigned long)start != start)
		return 0;
	rcu_read_lock();
	xa_for_each_start(&vgpu_ctxs, index, ctx, start) {
		if (n == max) {
			*next = index;
			break;
		}
		openers[n] = (struct vgpu_opener) {
			.start_boottime_ns = ctx->start_boottime,
		};
		out[n++] = (struct vgpu_context) {
			.ctx_id = ctx->id,
			.cgroup_id = ctx->cgroup_id,
			.node = ctx->node->kind,
			.minor = ctx->node->index,
			.pid = ctx->pid,
			.tgid = ctx->tgid,
			.uid = ctx->uid,
			.gid = ctx->gid,
		};
	}
	rcu_read_unlock();
	return n;
}
