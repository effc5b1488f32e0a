// SPDX-License-Identifier: GPL-2.0
/*
 * The emulated device files /dev/vgpu/{nvidiactl,nvidiaN,nvidia-uvm}: one
 * char major of our own, minors as NVIDIA's (GPU N = N, ctl = 255, uvm =
 * 254). Every open opens the matching backing driver file; calls are
 * forwarded to it, and the calls the daemon's filter selects are first
 * upcalled for a verdict.
 *
 * The backing nodes are resolved once, at load, in the loader's namespace,
 * and opened with the loader's credentials: what a caller's mount namespace
 * binds at /dev/nvidia* and who the caller is never change which file backs
 * an emulated one. A backing file must be a character device of the
 * expected driver module (backing_driver, backing_uvm_driver), never one of
 * ours.
 */
#include <linux/cdev.h>
#include <linux/cgroup.h>
#include <linux/cred.h>
#include <linux/device.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/namei.h>
#include <linux/poll.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "vgpu.h"
#include "compat.h"
#include "trace.h"

static dev_t vgpu_devt;
static struct cdev vgpu_cdev;
static struct class *vgpu_class;
/* The loader's credentials, for every backing open; held until unload. */
static const struct cred *vgpu_backing_cred;
/* Indexed by minor; filled before cdev_add(), read-only until unload. */
static struct vgpu_node_dev *vgpu_nodes[VGPU_MINORS];
static atomic64_t vgpu_ctx_ids = ATOMIC64_INIT(0);

/**
 * struct vgpu_call - one ioctl, after IOCTL_XFER_CMD unwrapping
 * @cmd: the command word as issued
 * @node: enum vgpu_node
 * @nr: escape number (UVM: the command)
 * @size: params size (UVM: 0, unknown)
 * @flags: VGPU_UPCALL_F_*
 * @xfer: an IOCTL_XFER_CMD call: the wrapper as the module read it, which
 *	the driver is given instead of the caller's (see vgpu_forward()); NULL
 *	for any other call
 * @params: the caller's params (the inner ones for XFER)
 * @arg: the ioctl argument as issued
 */
struct vgpu_call {
	u32 cmd;
	u32 node;
	u32 nr;
	u32 size;
	u32 flags;
	const struct nv_ioctl_xfer *xfer;
	void __user *params;
	unsigned long arg;
};

/*
 * The driver may have read something else than the shadow (it was unmapped
 * during the call): the context is revoked, every later call fails.
 */
static void vgpu_revoke(struct vgpu_ctx *ctx, u32 reason)
{
	struct vgpu_event ev = {
		.ctx_id = ctx->id,
		.kind = VGPU_EVENT_REVOKED,
		.nr = reason,
	};

	if (READ_ONCE(ctx->revoked))
		return;
	WRITE_ONCE(ctx->revoked, true);
	vgpu_count4(revoked);
	pr_warn_ratelimited("vgpu: context %llu revoked: its shadow was unmapped during a call\n",
			    ctx->id);
	vgpu_event(&ev, NULL, 0, NULL, 0);
}

/*
 * Calls the driver, on @sh when the call's blocks are shadowed (NULL: the
 * caller's memory). An IOCTL_XFER_CMD call without a shadow gets a copy
 * of the wrapper the module read (shadow.c): were the driver to read the
 * caller's again, a thread rewriting it in between would take a call past
 * the filter.
 */
static long vgpu_forward(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			 struct vgpu_shadow *sh)
{
	struct file *b = ctx->backing;
	struct vgpu_shadow own = {};
	unsigned long arg = c->arg;
	struct vgpu_fdx x;
	long ret;

	if (!b->f_op->unlocked_ioctl)
		return -ENOTTY;
	if (c->xfer) {
		ret = vgpu_shadow_map_wrapper(&own, ctx, c->xfer);
		if (ret)
			return ret;
		arg = own.arg;
		sh = &own;
	}
	ret = vgpu_fdx_prepare(&x, c->node, c->nr, c->size, c->params,
			       sh ? sh->kparams : NULL);
	if (ret)
		goto out;
	vgpu_shadow_enter(sh);
	ret = b->f_op->unlocked_ioctl(b, c->cmd, arg);
	if (!vgpu_shadow_leave(sh)) {
		vgpu_revoke(ctx, VGPU_REVOKE_SHADOW);
		ret = -EIO;
	}
	vgpu_fdx_finish(&x);
out:
	vgpu_shadow_unmap(&own);
	return ret;
}

static void vgpu_msg_init(struct vgpu_upcall_msg *m, struct vgpu_ctx *ctx,
			  u32 kind)
{
	memset(m, 0, sizeof(*m));
	m->ctx = ctx;
	m->hdr.ctx_id = ctx->id;
	m->hdr.cgroup_id = ctx->cgroup_id;
	m->hdr.kind = kind;
	m->hdr.node = ctx->node->kind;
	m->hdr.minor = ctx->node->index;
	m->hdr.pid = ctx->pid;
	m->hdr.tgid = ctx->tgid;
	m->hdr.uid = ctx->uid;
	m->hdr.gid = ctx->gid;
	m->hdr.caller_pid = task_pid_nr(current);
	m->hdr.caller_tgid = task_tgid_nr(current);
}

/*
 * Copies the buffer a rule points to: the rule's fixed length, else the
 * length the params give. Sets *flags on a length over VGPU_PARAMS_MAX or
 * an unreadable buffer; never fails the call. A NULL pointer under a fixed
 * length copies nothing: the driver sees the same NULL.
 */
static void *vgpu_copy_data(const struct vgpu_rule *r, const void *params,
			    u32 *len, u32 *flags)
{
	u64 ptr;
	void *data;

	*len = 0;
	if (r->ptr_off == VGPU_OFF_NONE)
		return NULL;
	ptr = get_unaligned((const u64 *)(params + r->ptr_off));
	if (r->flags & VGPU_RULE_F_LEN_FIXED) {
		if (!ptr)
			return NULL;
		*len = r->len_off;	/* 1..VGPU_PARAMS_MAX (filter.c) */
	} else {
		*len = get_unaligned((const u32 *)(params + r->len_off));
	}
	if (*len > VGPU_PARAMS_MAX) {
		*flags |= VGPU_UPCALL_F_DATA_BIG;
		*len = 0;
		return NULL;
	}
	if (!*len)
		return NULL;
	data = kvmalloc(*len, GFP_KERNEL);
	if (data && !copy_from_user(data, u64_to_user_ptr(ptr), *len))
		return data;
	kvfree(data);
	*flags |= VGPU_UPCALL_F_DATA_FAULT;
	*len = 0;
	return NULL;
}

/*
 * Copies the nested list the rule's buffer @data points to, in the
 * caller's context: the count is read once, from the module's copy of the
 * buffer. Sets *flags on a count over the rule's max_count (nothing copied)
 * or an unreadable list; never fails the call. A buffer too short to hold
 * the pointer and the count, or a count of 0, has no list.
 */
static void *vgpu_copy_list(const struct vgpu_rule_nested *n,
			    const void *data, u32 dlen, u64 *lptr, u32 *len,
			    u32 *flags)
{
	void *list;
	u32 count;

	*len = 0;
	if (!n->elem_size || !data || dlen < sizeof(u64) ||
	    n->ptr_off > dlen - sizeof(u64) || n->count_off > dlen - sizeof(u32))
		return NULL;
	count = get_unaligned((const u32 *)(data + n->count_off));
	*lptr = get_unaligned((const u64 *)(data + n->ptr_off));
	if (count > n->max_count) {
		*flags |= VGPU_UPCALL_F_DATA2_BIG;
		return NULL;
	}
	if (!count)
		return NULL;
	/* count <= max_count: elem_size * count <= VGPU_PARAMS_MAX (filter.c) */
	list = kvmalloc(count * n->elem_size, GFP_KERNEL);
	if (list && !copy_from_user(list, u64_to_user_ptr(*lptr),
				    count * n->elem_size)) {
		*len = count * n->elem_size;
		return list;
	}
	kvfree(list);
	*flags |= VGPU_UPCALL_F_DATA2_FAULT;
	return NULL;
}

/**
 * struct vgpu_slow - one slow-path call: its rule and its buffers
 * @rule: the rule that selected the call (its pointer field dropped when
 *	it lies beyond the call's params)
 * @params: the params as sent in the IOCTL upcall (@m.params_len bytes)
 * @data: the rule's buffer as sent (@m.data_len bytes), or NULL
 * @dptr: where @data lies in the caller's memory, as the daemon saw it
 * @ptr_off: where @dptr lies in @params (when @data is set)
 * @nested: the rule's nested list (@elem_size 0: none)
 * @list: the nested list as sent (@m.data2_len bytes), or NULL
 * @lptr: where @list lies in the caller's memory, as the daemon saw it (in
 *	@data at @nested.ptr_off)
 * @reply: @m.params_len + @m.data_len + @m.data2_len bytes for a REPLY's
 *	blocks, or NULL; after an ALLOW, scratch until a POST upcall
 * @m: the upcall
 * @small: @params, when they fit (most do: NVOS21 is 32 bytes, NVOS32 184)
 *
 * After an allowed call, @params, @data and @list hold the call's results,
 * which a POST event or upcall carries: read back from the shadow the
 * driver wrote.
 */
struct vgpu_slow {
	struct vgpu_rule rule;
	void *params;
	void *data;
	u64 dptr;
	u32 ptr_off;
	struct vgpu_rule_nested nested;
	void *list;
	u64 lptr;
	void *reply;
	struct vgpu_upcall_msg m;
	u8 small[256] __aligned(8);
};

/* Writes what a REPLY filled over the caller's params and buffer. */
static long vgpu_reply_write(const struct vgpu_call *c,
			     const struct vgpu_slow *s)
{
	const struct vgpu_upcall_msg *m = &s->m;

	if ((m->replied & VGPU_REPLIED_PARAMS) &&
	    copy_to_user(c->params, m->reply_params, m->params_len))
		return -EFAULT;
	if ((m->replied & VGPU_REPLIED_DATA) &&
	    copy_to_user(u64_to_user_ptr(s->dptr), m->reply_data, m->data_len))
		return -EFAULT;
	if ((m->replied & VGPU_REPLIED_DATA2) &&
	    copy_to_user(u64_to_user_ptr(s->lptr), m->reply_data2,
			 m->data2_len))
		return -EFAULT;
	return 0;
}

/* After an allowed call: report its results and the driver's @ret. */
static void vgpu_post_event(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			    struct vgpu_slow *s, long ret)
{
	struct vgpu_upcall_msg *m = &s->m;
	struct vgpu_event ev = {
		.ctx_id = ctx->id,
		.upcall_id = m->hdr.id,
		.kind = VGPU_EVENT_POST,
		.nr = c->nr,
		.ret = ret,
	};

	vgpu_event(&ev, m->params, m->params ? m->params_len : 0,
		   m->data, m->data ? m->data_len : 0);
}

/*
 * After a call allowed with VGPU_VERDICT_F_POST: a POST upcall with the
 * same id, the call's results and the driver's @dret. ALLOW keeps them
 * (the call returns @ret), REPLY replaces them (the call returns 0), and
 * FAIL_STATUS writes its status over the caller's (the daemon undid the
 * call: an allocation found over quota was freed; the call returns 0).
 * Without a verdict the call has still happened: its results stay,
 * whatever the fail policy; vgpu_upcall() counted why.
 */
static long vgpu_post_upcall(const struct vgpu_call *c, struct vgpu_slow *s,
			     long dret, long ret)
{
	struct vgpu_upcall_msg *m = &s->m;
	struct vgpu_verdict v;
	int out;

	m->hdr.kind = VGPU_UPCALL_POST;
	m->hdr.ret = dret;
	m->hdr.caller_pid = task_pid_nr(current);
	m->hdr.caller_tgid = task_tgid_nr(current);
	out = vgpu_upcall(m, &v);
	if (out != VGPU_OUT_VERDICT)
		return ret;
	switch (v.action) {
	case VGPU_VERDICT_REPLY:
		return vgpu_reply_write(c, s);
	case VGPU_VERDICT_FAIL_STATUS:
		/* Checked against the upcall: status_off + 4 <= its params. */
		if (put_user(v.status,
			     (u32 __user *)(c->params + v.status_off)))
			return -EFAULT;
		return 0;
	default:
		return ret;
	}
}

/*
 * A call the module read (an allowed one, under any rule): the driver runs
 * on the blocks the daemon checked (shadow.c). Its results are read back into
 * @s's buffers (the caller's pointers put back in the params and the
 * buffer), then written to the caller's params and, when the driver changed
 * them, to the caller's buffer and nested list. *dret is the driver's
 * return value, or the error that kept the driver from running (-EIO when
 * the context was revoked during the call).
 *
 * Return: what the caller gets: *dret, or -EFAULT when a result could not
 * be delivered (the driver ran; the real driver answers -EFAULT for a
 * params block it cannot write back, too).
 */
static long vgpu_forward_shadow(struct vgpu_ctx *ctx,
				const struct vgpu_call *c,
				struct vgpu_slow *s, long *dret)
{
	struct vgpu_upcall_msg *m = &s->m;
	struct nv_ioctl_xfer xfer = {};
	bool wrapped = c->flags & VGPU_UPCALL_F_XFER;
	struct vgpu_call sc = *c;
	struct vgpu_shadow_list sl = {};
	struct vgpu_shadow sh;
	bool data_changed = false, list_changed = false;
	void *after = m->reply_data;
	void *after2 = m->reply_data2;
	long ret;
	int err;

	if (wrapped) {
		xfer.cmd = c->xfer->cmd;
		xfer.size = m->params_len;
	}
	if (s->data && s->list) {
		sl.ptr_off = s->nested.ptr_off;
		sl.list = s->list;
		sl.len = m->data2_len;
	}
	err = vgpu_shadow_map(&sh, ctx, wrapped ? &xfer : NULL, s->params,
			      m->params_len, s->data ? s->ptr_off : VGPU_OFF_NONE,
			      s->data, m->data_len, sl.list ? &sl : NULL);
	if (err) {
		*dret = err;
		return err;
	}
	sc.params = sh.params;
	sc.arg = sh.arg;
	sc.xfer = NULL;		/* the shadow's wrapper is ours already */
	*dret = vgpu_forward(ctx, &sc, &sh);
	ret = *dret;

	memcpy(s->params, sh.kparams, m->params_len);
	if (s->data) {
		put_unaligned(s->dptr, (u64 *)(s->params + s->ptr_off));
		/* @after: the REPLY buffer, free until a POST upcall. */
		memcpy(after, sh.kdata, m->data_len);
		/* The caller's list pointer, not the shadow's. */
		if (sl.list)
			put_unaligned(s->lptr, (u64 *)(after + sl.ptr_off));
		if (memcmp(after, s->data, m->data_len)) {
			memcpy(s->data, after, m->data_len);
			data_changed = true;
		}
	}
	if (sl.list) {
		/* @after2: the REPLY's list, free until a POST upcall. */
		memcpy(after2, sh.klist, m->data2_len);
		if (memcmp(after2, s->list, m->data2_len)) {
			memcpy(s->list, after2, m->data2_len);
			list_changed = true;
		}
	}
	vgpu_shadow_unmap(&sh);

	if (copy_to_user(c->params, s->params, m->params_len))
		ret = -EFAULT;
	if (data_changed &&
	    copy_to_user(u64_to_user_ptr(s->dptr), s->data, m->data_len))
		ret = -EFAULT;
	if (list_changed &&
	    copy_to_user(u64_to_user_ptr(s->lptr), s->list, m->data2_len))
		ret = -EFAULT;
	return ret;
}

/*
 * Forwards a call the module read but did not send for a verdict (no rule's
 * key matched, or the fail-open policy): on a shadow of the @plen bytes it
 * read, so that a thread of the caller rewriting the key (an object class, a
 * control command, a VID_HEAP function) between the match and the driver's
 * read cannot take the call past the filter. The rule's buffer, if any, is
 * shadowed too. A call without params is forwarded as is.
 */
static long vgpu_forward_checked(struct vgpu_ctx *ctx,
				 const struct vgpu_call *c,
				 struct vgpu_slow *s, u32 plen)
{
	struct vgpu_upcall_msg *m = &s->m;
	long dret;

	if (!plen || !s->params)
		return vgpu_forward(ctx, c, NULL);
	if (!m->params) {
		/* Not prepared for an upcall: the params alone. */
		m->params = s->params;
		m->params_len = plen;
		m->data = NULL;
		s->data = NULL;
		m->data2 = NULL;
		s->list = NULL;
	}
	return vgpu_forward_shadow(ctx, c, s, &dret);
}

/*
 * Prepares a call for its upcall: copies @copy_size bytes of its params,
 * finds the rule that selects it and builds the IOCTL upcall in @s, with
 * the rule's buffer and the room a REPLY may fill.
 *
 * Return: 1 when a rule selects the call, 0 when none does (the filter
 * changed, or no rule's key matches: the call is forwarded), or a negative
 * errno. @s's buffers are the caller's to free in every case.
 */
static int vgpu_slow_prepare(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			     u32 copy_size, struct vgpu_slow *s)
{
	struct vgpu_upcall_msg *m = &s->m;
	struct vgpu_rule *r = &s->rule;
	u32 eff = 0;

	if (copy_size) {
		s->params = copy_size <= sizeof(s->small) ? s->small :
			    kvmalloc(copy_size, GFP_KERNEL);
		if (!s->params)
			return -ENOMEM;
		if (copy_from_user(s->params, c->params, copy_size))
			return -EFAULT;
	}
	if (!vgpu_filter_match(c->node, c->nr, copy_size, s->params, r,
			       &s->nested, &eff))
		return 0;

	vgpu_msg_init(m, ctx, VGPU_UPCALL_IOCTL);
	m->hdr.cmd = c->cmd;
	m->hdr.nr = c->nr;
	m->hdr.flags = c->flags;
	m->params = eff ? s->params : NULL;
	m->params_len = eff;
	/* A rule for any size may name offsets beyond this call's params. */
	if (r->ptr_off != VGPU_OFF_NONE &&
	    (eff < sizeof(u64) || r->ptr_off > eff - sizeof(u64) ||
	     (!(r->flags & VGPU_RULE_F_LEN_FIXED) &&
	      r->len_off > eff - sizeof(u32))))
		r->ptr_off = VGPU_OFF_NONE;
	s->data = vgpu_copy_data(r, s->params, &m->data_len, &m->hdr.flags);
	m->data = s->data;
	if (s->data) {
		s->dptr = get_unaligned((const u64 *)(s->params + r->ptr_off));
		s->ptr_off = r->ptr_off;
	}
	s->list = vgpu_copy_list(&s->nested, s->data, m->data_len, &s->lptr,
				 &m->data2_len, &m->hdr.flags);
	m->data2 = s->list;
	if (eff || s->data) {
		s->reply = kvmalloc((size_t)eff + m->data_len + m->data2_len,
				    GFP_KERNEL);
		if (!s->reply)
			return -ENOMEM;
		m->reply_params = eff ? s->reply : NULL;
		m->reply_data = s->data ? s->reply + eff : NULL;
		m->reply_data2 = s->list ? s->reply + eff + m->data_len : NULL;
	}
	return 1;
}

/*
 * An ALLOW that carried params (v5): the driver reads those instead of the
 * checked ones, but for the rule's pointer field, which stays the one the
 * module copied the buffer from (the shadow names its own copy there).
 */
static void vgpu_params_rewrite(struct vgpu_slow *s)
{
	struct vgpu_upcall_msg *m = &s->m;

	memcpy(s->params, m->reply_params, m->params_len);
	if (s->data)
		put_unaligned(s->dptr, (u64 *)(s->params + s->ptr_off));
}

/*
 * An ALLOW: calls the driver (on the shadow under a shadow rule), then
 * turns a new channel group off and reports the results, as the verdict
 * and the rule ask.
 */
static long vgpu_slow_allow(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			    struct vgpu_slow *s, const struct vgpu_verdict *v)
{
	struct vgpu_upcall_msg *m = &s->m;
	u32 rflags = s->rule.flags;
	bool group = (v->flags & VGPU_VERDICT_F_SCHED_OFF) && m->params &&
		     vgpu_sched_alloc_layout(c->nr, m->params_len);
	struct nvos21 checked;
	long ret, dret;

	if (m->replied & VGPU_REPLIED_PARAMS)
		vgpu_params_rewrite(s);
	/* The checked head, before the results are read back over it. */
	if (group)
		memcpy(&checked, s->params, sizeof(checked));
	/* Every call with params runs on the checked copy (and reports it). */
	if (m->params) {
		ret = vgpu_forward_shadow(ctx, c, s, &dret);
	} else {
		ret = vgpu_forward(ctx, c, NULL);
		dret = ret;
	}
	/* Off before the caller, or the daemon, hears of the group. */
	if (group && !dret)
		vgpu_sched_new_group(ctx, &checked,
				     m->params ? s->params : NULL);
	if (v->flags & VGPU_VERDICT_F_POST)
		ret = vgpu_post_upcall(c, s, dret, ret);
	else if (rflags & VGPU_RULE_F_POST)
		vgpu_post_event(ctx, c, s, dret);
	return ret;
}

/* Applies the daemon's verdict (checked against the upcall) to the call. */
static long vgpu_slow_apply(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			    struct vgpu_slow *s, const struct vgpu_verdict *v)
{
	switch (v->action) {
	case VGPU_VERDICT_ALLOW:
		return vgpu_slow_allow(ctx, c, s, v);
	case VGPU_VERDICT_DENY:
		return -(long)v->error;
	case VGPU_VERDICT_FAIL_STATUS:
		/* Checked against the upcall: status_off + 4 <= eff. */
		if (put_user(v->status,
			     (u32 __user *)(c->params + v->status_off)))
			return -EFAULT;
		return 0;
	case VGPU_VERDICT_REPLY:
		/* Checked against the upcall: blocks as long as those sent. */
		return vgpu_reply_write(c, s);
	default:
		return -EIO;	/* unreachable: verdicts are validated */
	}
}

/*
 * A call some rule may select: prepare, upcall, apply the verdict. @key is
 * set to the value that selected the rule (0: none did).
 */
static long vgpu_ioctl_slow(struct vgpu_ctx *ctx, const struct vgpu_call *c,
			    u32 copy_size, u32 *key)
{
	struct vgpu_slow s = {};
	struct vgpu_verdict v;
	long ret;
	int out;

	out = vgpu_slow_prepare(ctx, c, copy_size, &s);
	if (out < 0) {
		ret = out;
		goto out;
	}
	if (!out) {
		/* No rule's key: the driver reads the key the module matched. */
		ret = vgpu_forward_checked(ctx, c, &s, copy_size);
		goto out;
	}
	/* vgpu_filter_match checked match_off against the params' size. */
	if (s.rule.match_off != VGPU_OFF_NONE)
		*key = get_unaligned((const u32 *)(s.params + s.rule.match_off));
	out = vgpu_upcall(&s.m, &v);
	if (out < 0)
		ret = out;
	else if (out == VGPU_OUT_FORWARD)
		ret = vgpu_forward_checked(ctx, c, &s, s.m.params_len);
	else
		ret = vgpu_slow_apply(ctx, c, &s, &v);
out:
	kvfree(s.reply);
	kvfree(s.list);
	kvfree(s.data);
	if (s.params != s.small)
		kvfree(s.params);
	return ret;
}

/* A call that no rule, wrapper or fd argument concerns: forward it as is. */
static long vgpu_ioctl_plain(struct vgpu_ctx *ctx, unsigned int cmd, u32 nr,
			     unsigned long arg)
{
	struct file *b = ctx->backing;
	long ret = -ENOTTY;

	trace_vgpu_ioctl_enter(ctx->id, cmd, nr);
	if (b->f_op->unlocked_ioctl)
		ret = b->f_op->unlocked_ioctl(b, cmd, arg);
	trace_vgpu_ioctl_exit(ctx->id, nr, ret, false, 0);
	return ret;
}

static long vgpu_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct vgpu_ctx *ctx = file->private_data;
	u32 node = ctx->node->kind;
	struct vgpu_call c = {
		.cmd = cmd,
		.node = node,
		.params = (void __user *)arg,
		.arg = arg,
	};
	struct nv_ioctl_xfer xfer;
	u32 copy_size, key = 0;
	bool slow = false;
	long ret;

	vgpu_count(ioctls);
	if (READ_ONCE(ctx->revoked))
		return -EIO;
	if (node == VGPU_NODE_UVM) {
		c.nr = cmd;
	} else {
		c.nr = _IOC_NR(cmd);
		c.size = _IOC_SIZE(cmd);
	}
	if (!vgpu_nr_hot(node, c.nr))
		return vgpu_ioctl_plain(ctx, cmd, c.nr, arg);
	if (c.node != VGPU_NODE_UVM && c.nr == NV_ESC_IOCTL_XFER_CMD &&
	    c.size == sizeof(xfer)) {
		if (copy_from_user(&xfer, c.params, sizeof(xfer)))
			return -EFAULT;
		c.xfer = &xfer;
		/*
		 * Oversized: left to the driver, which refuses it. The driver
		 * takes the wrapper's cmd as the escape number, whole: a value
		 * with bits above the low 8 selects no rule and reaches the
		 * driver as it was read, to be refused there.
		 */
		if (xfer.size <= VGPU_PARAMS_MAX) {
			c.nr = xfer.cmd;
			c.size = xfer.size;
			c.params = u64_to_user_ptr(xfer.ptr);
			c.flags = VGPU_UPCALL_F_XFER;
		}
	}

	trace_vgpu_ioctl_enter(ctx->id, cmd, c.nr);
	copy_size = c.size;
	if (vgpu_filter_candidates(c.node, c.nr, &copy_size)) {
		slow = true;
		ret = vgpu_ioctl_slow(ctx, &c, copy_size, &key);
	} else {
		ret = vgpu_forward(ctx, &c, NULL);
	}
	trace_vgpu_ioctl_exit(ctx->id, c.nr, ret, slow, key);
	return ret;
}

static int vgpu_open_upcall(struct vgpu_ctx *ctx)
{
	struct vgpu_opener opener = {
		.start_boottime_ns = ctx->start_boottime,
	};
	struct vgpu_upcall_msg m;
	struct vgpu_verdict v;
	char *cgpath = NULL;
	int out;

#ifdef CONFIG_CGROUPS
	cgpath = kmalloc(PATH_MAX, GFP_KERNEL);
	if (cgpath) {
		rcu_read_lock();
		if (cgroup_path(task_dfl_cgroup(current), cgpath, PATH_MAX) < 0) {
			kfree(cgpath);
			cgpath = NULL;
		}
		rcu_read_unlock();
	}
#endif
	vgpu_msg_init(&m, ctx, VGPU_UPCALL_OPEN);
	m.cgroup = cgpath;
	m.opener = &opener;
	out = vgpu_upcall(&m, &v);
	kfree(cgpath);
	if (out < 0)
		return out;
	if (out == VGPU_OUT_FORWARD)
		return 0;
	switch (v.action) {
	case VGPU_VERDICT_ALLOW:
		return 0;
	case VGPU_VERDICT_DENY:
		return -(int)v.error;
	default:
		return -EACCES;	/* FAIL_STATUS: refused for OPEN upcalls */
	}
}

/* Is @f a file of module @driver (and not one of ours)? */
static bool vgpu_backing_owned(const struct file *f, const char *driver)
{
	struct module *owner = f->f_op ? f->f_op->owner : NULL;

	if (!S_ISCHR(file_inode(f)->i_mode) || f->f_op == &vgpu_fops ||
	    !owner || owner == THIS_MODULE)
		return false;
	return !strcmp(module_name(owner), driver);
}

/*
 * Opens @nd's backing node: the path resolved at load, with the loader's
 * credentials. A node of our own major is refused before it is opened (no
 * recursion); a file that is not the expected driver's after.
 */
static struct file *vgpu_backing_open(const struct vgpu_node_dev *nd,
				      int flags)
{
	struct inode *inode = d_inode(nd->path.dentry);
	struct file *f;

	if (!inode || !S_ISCHR(inode->i_mode) ||
	    imajor(inode) == MAJOR(vgpu_devt))
		return ERR_PTR(-ENXIO);
	f = dentry_open(&nd->path, flags & ~(O_CREAT | O_EXCL | O_TRUNC |
					     O_NOCTTY), vgpu_backing_cred);
	if (IS_ERR(f))
		return f;
	if (!vgpu_backing_owned(f, nd->driver)) {
		fput(f);
		return ERR_PTR(-ENXIO);
	}
	return f;
}

static void vgpu_ctx_fill(struct vgpu_ctx *ctx, const struct vgpu_node_dev *nd)
{
	ctx->id = atomic64_inc_return(&vgpu_ctx_ids);
	ctx->node = nd;
	ctx->pid = task_pid_nr(current);
	ctx->tgid = task_tgid_nr(current);
	ctx->uid = from_kuid_munged(&init_user_ns, current_fsuid());
	ctx->gid = from_kgid_munged(&init_user_ns, current_fsgid());
	ctx->start_boottime = current->group_leader->start_boottime;
	mutex_init(&ctx->shadow.lock);
#ifdef CONFIG_CGROUPS
	rcu_read_lock();
	ctx->cgroup_id = cgroup_id(task_dfl_cgroup(current));
	rcu_read_unlock();
#endif
}

/*
 * The OPEN verdict comes first: an opener the daemon refuses never reaches
 * the driver. When the open fails after an allowed OPEN upcall, a CLOSE
 * event tells the daemon the context it heard of is gone.
 */
static int vgpu_open(struct inode *inode, struct file *file)
{
	struct vgpu_node_dev *nd = vgpu_nodes[iminor(inode)];
	struct vgpu_event ev = { .kind = VGPU_EVENT_CLOSE };
	bool upcalled = false;
	struct vgpu_ctx *ctx;
	struct file *backing;
	int err;

	if (!nd)
		return -ENXIO;
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	vgpu_ctx_fill(ctx, nd);
	err = vgpu_slots_attach(ctx);
	if (err)
		goto err_free_ctx;

	if (vgpu_filter_wants(VGPU_FILTER_OPEN)) {
		err = vgpu_open_upcall(ctx);
		if (err)
			goto err_detach;
		upcalled = true;
	}
	backing = vgpu_backing_open(nd, file->f_flags);
	if (IS_ERR(backing)) {
		err = PTR_ERR(backing);
		goto err_closed;
	}
	ctx->backing = backing;
	err = vgpu_ctx_register(ctx);
	if (err)
		goto err_put_backing;

	file->private_data = ctx;
	vgpu_count(contexts);
	vgpu_count(opens);
	return 0;

err_put_backing:
	fput(backing);
err_closed:
	if (upcalled) {
		ev.ctx_id = ctx->id;
		vgpu_event(&ev, NULL, 0, NULL, 0);
	}
err_detach:
	vgpu_slots_detach(ctx);
err_free_ctx:
	kfree(ctx);
	return err;
}

static int vgpu_release(struct inode *inode, struct file *file)
{
	struct vgpu_ctx *ctx = file->private_data;
	struct vgpu_event ev = {
		.ctx_id = ctx->id,
		.kind = VGPU_EVENT_CLOSE,
	};

	vgpu_ctx_unregister(ctx);
	vgpu_sched_forget(ctx->id);
	vgpu_shadow_release(ctx);
	vgpu_event(&ev, NULL, 0, NULL, 0);
	vgpu_slots_detach(ctx);
	fput(ctx->backing);
	kfree_rcu(ctx, rcu);
	vgpu_uncount(contexts);
	return 0;
}

/*
 * MMAP upcall of a nvidia-uvm mapping (VGPU_FILTER_UVM_MMAP). Runs under the
 * caller's mmap_lock, held for writing: other threads of the caller that
 * fault or map wait for the verdict too, at most upcall_timeout_ms (the
 * wait is killable). The daemon never touches the caller's memory, so the
 * verdict cannot wait for this lock.
 */
static int vgpu_mmap_upcall(struct vgpu_ctx *ctx, struct vm_area_struct *vma)
{
	struct vgpu_mmap_params p = {
		.pgoff = vma->vm_pgoff,
		.length = vma->vm_end - vma->vm_start,
		.flags = (vma->vm_flags & VM_MAYSHARE) ? MAP_SHARED :
							 MAP_PRIVATE,
	};
	struct vgpu_upcall_msg m;
	struct vgpu_verdict v;
	int out;

	/* The uapi's values of flags are the x86-64 ones. */
	BUILD_BUG_ON(MAP_SHARED != 1 || MAP_PRIVATE != 2);
	if (vma->vm_flags & VM_READ)
		p.prot |= PROT_READ;
	if (vma->vm_flags & VM_WRITE)
		p.prot |= PROT_WRITE;
	if (vma->vm_flags & VM_EXEC)
		p.prot |= PROT_EXEC;
	vgpu_msg_init(&m, ctx, VGPU_UPCALL_MMAP);
	m.params = &p;
	m.params_len = sizeof(p);
	out = vgpu_upcall(&m, &v);
	if (out < 0)
		return out;
	if (out == VGPU_OUT_FORWARD)
		return 0;
	/* Only ALLOW and DENY fit an MMAP upcall. */
	return v.action == VGPU_VERDICT_DENY ? -(int)v.error : 0;
}

static int vgpu_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct vgpu_ctx *ctx = file->private_data;
	struct file *b = ctx->backing;
	int err;

	if (!b->f_op->mmap)
		return -ENODEV;
	if (READ_ONCE(ctx->revoked))
		return -EIO;
	if (ctx->node->kind == VGPU_NODE_UVM &&
	    vgpu_filter_wants(VGPU_FILTER_UVM_MMAP)) {
		err = vgpu_mmap_upcall(ctx, vma);
		if (err)
			return err;
	}
	vma_set_file(vma, b);
	vgpu_count(mmaps);
	return call_mmap(b, vma);
}

static __poll_t vgpu_poll(struct file *file, struct poll_table_struct *pt)
{
	struct vgpu_ctx *ctx = file->private_data;

	return vfs_poll(ctx->backing, pt);
}

const struct file_operations vgpu_fops = {
	.owner		= THIS_MODULE,
	.open		= vgpu_open,
	.release	= vgpu_release,
	.unlocked_ioctl	= vgpu_ioctl,
	.compat_ioctl	= vgpu_ioctl,
	.mmap		= vgpu_mmap,
	.poll		= vgpu_poll,
	.llseek		= noop_llseek,
};

static char *vgpu_devnode(VGPU_DEVNODE_CONST struct device *dev, umode_t *mode)
{
	if (mode)
		*mode = 0666;
	return kasprintf(GFP_KERNEL, "vgpu/%s", dev_name(dev));
}

static void vgpu_nodes_free(void)
{
	int i;

	for (i = 0; i < VGPU_MINORS; i++) {
		if (!vgpu_nodes[i])
			continue;
		path_put(&vgpu_nodes[i]->path);
		kfree(vgpu_nodes[i]);
		vgpu_nodes[i] = NULL;
	}
}

/*
 * Resolves @nd's backing node under backing_dir and opens it once to check
 * it. Return: 0 when it is fit, -ENOENT when there is none, or why not.
 */
static int vgpu_node_resolve(struct vgpu_node_dev *nd)
{
	struct file *f;
	char *bpath;
	int err;

	bpath = kasprintf(GFP_KERNEL, "%s/%s", vgpu_backing_dir, nd->name);
	if (!bpath)
		return -ENOMEM;
	err = kern_path(bpath, LOOKUP_FOLLOW, &nd->path);
	if (err)
		goto out;
	f = vgpu_backing_open(nd, O_RDWR);
	if (IS_ERR(f)) {
		err = PTR_ERR(f);
		pr_warn("vgpu: %s is not a %s device (%d): no node %s\n",
			bpath, nd->driver, err, nd->name);
		path_put(&nd->path);
		goto out;
	}
	fput(f);
out:
	kfree(bpath);
	return err;
}

/* Adds the node of @minor when its backing node exists and is fit. */
static int vgpu_node_probe(unsigned int minor, u32 kind, u32 index,
			   const char *name)
{
	struct vgpu_node_dev *nd;
	int err;

	nd = kzalloc(sizeof(*nd), GFP_KERNEL);
	if (!nd)
		return -ENOMEM;
	nd->kind = kind;
	nd->index = index;
	strscpy(nd->name, name, sizeof(nd->name));
	nd->driver = kind == VGPU_NODE_UVM ? vgpu_backing_uvm_driver :
					     vgpu_backing_driver;
	err = vgpu_node_resolve(nd);
	if (err) {
		kfree(nd);
		return err == -ENOMEM ? err : 0;
	}
	vgpu_nodes[minor] = nd;
	return 0;
}

static int vgpu_nodes_probe(void)
{
	char name[16];
	unsigned int i;
	int err;

	err = vgpu_node_probe(VGPU_MINOR_CTL, VGPU_NODE_CTL, 0, "nvidiactl");
	if (err)
		return err;
	if (!vgpu_nodes[VGPU_MINOR_CTL]) {
		pr_err("vgpu: no backing %s/nvidiactl of %s\n",
		       vgpu_backing_dir, vgpu_backing_driver);
		return -ENODEV;
	}
	for (i = 0; i < VGPU_MAX_GPUS; i++) {
		snprintf(name, sizeof(name), "nvidia%u", i);
		err = vgpu_node_probe(i, VGPU_NODE_GPU, i, name);
		if (err)
			return err;
	}
	return vgpu_node_probe(VGPU_MINOR_UVM, VGPU_NODE_UVM, 0, "nvidia-uvm");
}

static void vgpu_devices_destroy(void)
{
	int i;

	for (i = VGPU_MINORS - 1; i >= 0; i--) {
		if (vgpu_nodes[i] && vgpu_nodes[i]->dev) {
			device_destroy(vgpu_class, MKDEV(MAJOR(vgpu_devt), i));
			vgpu_nodes[i]->dev = NULL;
		}
	}
}

static int vgpu_devices_create(void)
{
	struct device *dev;
	int i;

	for (i = 0; i < VGPU_MINORS; i++) {
		if (!vgpu_nodes[i])
			continue;
		/* The device name is the backing node's name. */
		dev = device_create(vgpu_class, NULL,
				    MKDEV(MAJOR(vgpu_devt), i), NULL, "%s",
				    vgpu_nodes[i]->name);
		if (IS_ERR(dev)) {
			vgpu_devices_destroy();
			return PTR_ERR(dev);
		}
		vgpu_nodes[i]->dev = dev;
	}
	return 0;
}

/*
 * The loader's credentials, our major (so that no backing can be ours), the
 * backing nodes, then the files: undone in reverse order by the error path
 * and by exit alike.
 */
int vgpu_chardev_init(void)
{
	int err;

	vgpu_backing_cred = get_current_cred();
	err = alloc_chrdev_region(&vgpu_devt, 0, VGPU_MINORS, "vgpu");
	if (err)
		goto err_cred;
	err = vgpu_nodes_probe();
	if (err)
		goto err_nodes;
	vgpu_class = vgpu_class_create("vgpu");
	if (IS_ERR(vgpu_class)) {
		err = PTR_ERR(vgpu_class);
		goto err_nodes;
	}
	vgpu_class->devnode = vgpu_devnode;
	cdev_init(&vgpu_cdev, &vgpu_fops);
	vgpu_cdev.owner = THIS_MODULE;
	err = cdev_add(&vgpu_cdev, vgpu_devt, VGPU_MINORS);
	if (err)
		goto err_class;
	err = vgpu_devices_create();
	if (err)
		goto err_cdev;
	return 0;

err_cdev:
	cdev_del(&vgpu_cdev);
err_class:
	class_destroy(vgpu_class);
err_nodes:
	vgpu_nodes_free();
	unregister_chrdev_region(vgpu_devt, VGPU_MINORS);
err_cred:
	put_cred(vgpu_backing_cred);
	return err;
}

void vgpu_chardev_exit(void)
{
	vgpu_devices_destroy();
	cdev_del(&vgpu_cdev);
	class_destroy(vgpu_class);
	vgpu_nodes_free();
	unregister_chrdev_region(vgpu_devt, VGPU_MINORS);
	put_cred(vgpu_backing_cred);
}
