// SPDX-License-Identifier: GPL-2.0
/*
 * The slow path: an ioctl that some rule of the daemon's filter may select
 * (vgpu_filter_candidates()). The module copies its params once and matches
 * them; a call a rule selects becomes an IOCTL upcall, with the rule's
 * buffer and its nested list, and the daemon's verdict is applied: ALLOW
 * calls the driver on a shadow of what the daemon checked (shadow.c) and
 * reports the results (a POST event or upcall), DENY fails the call,
 * FAIL_STATUS writes a status over the caller's, REPLY writes the daemon's
 * blocks. A call no rule's key matched, and a fail-open forward, run on a
 * shadow of what the module read too.
 *
 * chardev.c chooses the path and calls the driver (vgpu_forward());
 * vgpu_ioctl_slow() is the way in.
 */
#include <linux/mm.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/uaccess.h>

#include "vgpu.h"
#include "compat.h"

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
long vgpu_ioctl_slow(struct vgpu_ctx *ctx, const struct vgpu_call *c,
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
