// SPDX-License-Identifier: GPL-2.0
/*
 * Upcalls to the daemon: the registered responder, the table of pending
 * upcalls and the fail policy.
 *
 * Every upcall completes exactly once. Four parties race to complete it: the
 * verdict handler, the daemon's death (URELEASE or UNREGISTER), the waiter's
 * timeout and a fatal signal to the waiter. Whoever unlinks the request from
 * the pending table under vgpu_daemon.lock owns the outcome; the others see
 * an unlinked request and back off. The table is a hash by upcall id, so a
 * verdict finds its request without walking the others.
 *
 * Before it is sent, an upcall takes a slot of its context, of its opener
 * and of the module (struct vgpu_opener_slots, vgpu_slots): a caller over a
 * bound waits for a slot instead of sending, so that no tenant's callers
 * fill the daemon's socket and the others' upcalls always find room.
 */
#include <linux/completion.h>
#include <linux/jiffies.h>
#include <linux/hashtable.h>
#include <linux/sched.h>
#include <linux/skbuff.h>
#include <linux/slab.h>
#include <linux/spinlock.h>
#include <linux/wait.h>
#include "compat.h"
#include <net/net_namespace.h>

#include "vgpu.h"
#include "trace.h"

/**
 * struct vgpu_req - one upcall waiting for its verdict (on the waiter's stack)
 * @node: link in vgpu_daemon.pending, by @id; unhashed once the request is
 *	owned
 * @id: the upcall id
 * @kind: enum vgpu_upcall_kind, decides which verdicts fit
 * @nr: the escape number (VGPU_VERDICT_F_SCHED_OFF fits RM_ALLOC only)
 * @params_len: size of the params sent (0: none), bounds FAIL_STATUS's
 *	offset and is the exact size of a REPLY's PARAMS
 * @data_len: size of the data sent (0: none), exact size of a REPLY's DATA
 * @reply_params: @params_len bytes of the waiter's, filled by a REPLY
 * @reply_data: @data_len bytes of the waiter's, filled by a REPLY
 * @data2_len: size of the nested list sent (0: none), exact size of a
 *	REPLY's DATA2
 * @reply_data2: @data2_len bytes of the waiter's, filled by a REPLY
 * @replied: VGPU_REPLIED_* bits, what a REPLY filled
 * @done: completed, under the lock, by whoever unlinks @node other than
 *	the waiter
 * @err: 0: @verdict holds the daemon's answer; else the fail-policy errno
 * @verdict: the daemon's answer
 *
 * The reply buffers are allocated by the waiter before the upcall is sent
 * and only written by the verdict handler while it owns the request, so the
 * handler never allocates and never writes past what the waiter sent.
 */
struct vgpu_req {
	struct hlist_node node;
	u64 id;
	u32 kind;
	u32 nr;
	u32 params_len;
	u32 data_len;
	void *reply_params;
	void *reply_data;
	u32 data2_len;
	void *reply_data2;
	u32 replied;
	struct completion done;
	int err;
	struct vgpu_verdict verdict;
};

/*
 * The registered responder and the upcalls sent to it. @lock protects all
 * fields and the hash links of every request in @pending: a request is
 * added, found and removed only under it. It is only taken in process
 * context and never held while sleeping or copying user memory.
 */
static struct {
	spinlock_t lock;		/* protects the fields below */
	struct net *net;		/* reference held while registered */
	u32 portid;			/* 0 when no daemon is registered */
	DECLARE_HASHTABLE(pending, 8);	/* struct vgpu_req.node, by id */
} vgpu_daemon = {
	.lock = __SPIN_LOCK_UNLOCKED(vgpu_daemon.lock),
};

static atomic64_t vgpu_upcall_ids = ATOMIC64_INIT(0);

/**
 * struct vgpu_opener_slots - the upcall slots of one opener
 * @node: link in vgpu_slots.openers, by vgpu_opener_key()
 * @cgroup_id: the openers' cgroup v2 id, at open
 * @uid: their fsuid, at open (init user namespace)
 * @users: contexts opened by them that are not released yet
 * @inflight: upcalls in flight from those contexts, at most
 *	upcalls_per_opener
 * @wait: callers of those contexts waiting for one of its slots
 *
 * An opener is what the module knows of a tenant: the uid and cgroup that
 * opened a context, whichever process calls on it now. Freed when its last
 * context is released.
 */
struct vgpu_opener_slots {
	struct hlist_node node;
	u64 cgroup_id;
	u32 uid;
	u32 users;
	u32 inflight;
	wait_queue_head_t wait;
};

/*
 * The upcall slots. @lock protects every count of them (@inflight here,
 * struct vgpu_ctx.inflight, struct vgpu_opener_slots.inflight and .users)
 * and the links of @openers; it is only taken in process context and never
 * held while sleeping. The limits are module parameters fixed at load.
 */
static struct {
	spinlock_t lock;		/* protects the fields below */
	u32 inflight;			/* upcalls in flight, <= upcalls_max */
	wait_queue_head_t wait;		/* callers waiting for one of those */
	DECLARE_HASHTABLE(openers, 6);	/* struct vgpu_opener_slots.node */
} vgpu_slots = {
	.lock = __SPIN_LOCK_UNLOCKED(vgpu_slots.lock),
	.wait = __WAIT_QUEUE_HEAD_INITIALIZER(vgpu_slots.wait),
};

static u64 vgpu_opener_key(u32 uid, u64 cgroup_id)
{
	return ((u64)uid << 32) ^ cgroup_id;
}

/**
 * vgpu_slots_attach - give a new context its opener's upcall slots
 * @ctx: the context, its opener filled in, not yet upcalled for
 *
 * Return: 0, or -ENOMEM (the open fails).
 */
int vgpu_slots_attach(struct vgpu_ctx *ctx)
{
	u64 key = vgpu_opener_key(ctx->uid, ctx->cgroup_id);
	struct vgpu_opener_slots *o, *fresh;

	ctx->inflight = 0;
	init_waitqueue_head(&ctx->slot_wait);
	fresh = kzalloc(sizeof(*fresh), GFP_KERNEL);
	if (!fresh)
		return -ENOMEM;
	fresh->uid = ctx->uid;
	fresh->cgroup_id = ctx->cgroup_id;
	init_waitqueue_head(&fresh->wait);

	spin_lock(&vgpu_slots.lock);
	hash_for_each_possible(vgpu_slots.openers, o, node, key)
		if (o->uid == ctx->uid && o->cgroup_id == ctx->cgroup_id)
			break;
	if (!o) {
		o = fresh;
		fresh = NULL;
		hash_add(vgpu_slots.openers, &o->node, key);
	}
	o->users++;
	ctx->slots = o;
	spin_unlock(&vgpu_slots.lock);
	kfree(fresh);
	return 0;
}

/*
 * The context is released (or its open failed): nothing calls on it, so
 * nothing waits for its slots; its opener's go with its last context.
 */
void vgpu_slots_detach(struct vgpu_ctx *ctx)
{
	struct vgpu_opener_slots *o = ctx->slots, *gone = NULL;

	if (!o)
		return;
	spin_lock(&vgpu_slots.lock);
	if (!--o->users) {
		hash_del(&o->node);
		gone = o;
	}
	spin_unlock(&vgpu_slots.lock);
	ctx->slots = NULL;
	kfree(gone);
}

/* Takes one of @max slots counted by *@inflight, when one is free. */
static bool vgpu_slot_take(u32 *inflight, unsigned int max)
{
	bool taken;

	spin_lock(&vgpu_slots.lock);
	taken = *inflight < max;
	if (taken)
		(*inflight)++;
	spin_unlock(&vgpu_slots.lock);
	return taken;
}

/* Gives a slot back and wakes the first caller waiting for one. */
static void vgpu_slot_give(u32 *inflight, wait_queue_head_t *wait)
{
	spin_lock(&vgpu_slots.lock);
	(*inflight)--;
	spin_unlock(&vgpu_slots.lock);
	wake_up(wait);
}

/*
 * Takes one of @max slots, waiting (killable) while none is free; the first
 * wait of an upcall counts as throttled. The waiters are exclusive and
 * queued in the order they came: a slot given back wakes the first. One
 * that is woken and killed at once either takes the slot (the condition is
 * checked again) or finds it taken, so no free slot is left with waiters.
 */
static int vgpu_slot_wait(u32 *inflight, unsigned int max,
			  wait_queue_head_t *wait, bool *throttled)
{
	if (vgpu_slot_take(inflight, max))
		return 0;
	if (!*throttled) {
		*throttled = true;
		vgpu_count4(throttled);
	}
	if (wait_event_killable_exclusive(*wait, vgpu_slot_take(inflight, max)))
		return -EINTR;
	return 0;
}

/*
 * One slot of @ctx, of its opener and of the module, taken in that order
 * and given back in the reverse one. A caller holds at most one upcall's
 * slots at a time (a POST upcall takes them again after the call), so the
 * order is the only one and no waiter holds what another waits for but
 * slots that a verdict or a timeout gives back.
 */
static int vgpu_slots_get(struct vgpu_ctx *ctx)
{
	struct vgpu_opener_slots *o = ctx->slots;
	bool throttled = false;
	int err;

	err = vgpu_slot_wait(&ctx->inflight, vgpu_upcalls_per_ctx,
			     &ctx->slot_wait, &throttled);
	if (err)
		return err;
	err = vgpu_slot_wait(&o->inflight, vgpu_upcalls_per_opener, &o->wait,
			     &throttled);
	if (err)
		goto err_ctx;
	err = vgpu_slot_wait(&vgpu_slots.inflight, vgpu_upcalls_max,
			     &vgpu_slots.wait, &throttled);
	if (err)
		goto err_opener;
	return 0;

err_opener:
	vgpu_slot_give(&o->inflight, &o->wait);
err_ctx:
	vgpu_slot_give(&ctx->inflight, &ctx->slot_wait);
	return err;
}

static void vgpu_slots_put(struct vgpu_ctx *ctx)
{
	vgpu_slot_give(&vgpu_slots.inflight, &vgpu_slots.wait);
	vgpu_slot_give(&ctx->slots->inflight, &ctx->slots->wait);
	vgpu_slot_give(&ctx->inflight, &ctx->slot_wait);
}

/* Caller holds vgpu_daemon.lock. Completes every pending request with @err. */
static void vgpu_pending_fail_locked(int err)
{
	struct vgpu_req *req;
	struct hlist_node *tmp;
	unsigned int bkt;

	hash_for_each_safe(vgpu_daemon.pending, bkt, tmp, req, node) {
		hash_del(&req->node);
		req->err = err;
		complete(&req->done);
	}
}

/* The pending request @id, or NULL. Caller holds vgpu_daemon.lock. */
static struct vgpu_req *vgpu_pending_find_locked(u64 id)
{
	struct vgpu_req *req;

	/* At most one request per id is pending (see vgpu_upcall()). */
	hash_for_each_possible(vgpu_daemon.pending, req, node, id)
		if (req->id == id)
			return req;
	return NULL;
}

/* Drops the registered daemon; caller holds the lock. Returns its net. */
static struct net *vgpu_daemon_clear_locked(void)
{
	struct net *net = vgpu_daemon.net;

	vgpu_daemon.net = NULL;
	vgpu_daemon.portid = 0;
	vgpu_pending_fail_locked(-EHOSTDOWN);
	return net;
}

static bool vgpu_daemon_match_locked(struct net *net, u32 portid)
{
	return vgpu_daemon.portid && vgpu_daemon.portid == portid &&
	       net_eq(vgpu_daemon.net, net);
}

int vgpu_daemon_register(struct net *net, u32 portid, bool *fresh)
{
	int err = 0;

	*fresh = false;
	spin_lock(&vgpu_daemon.lock);
	if (vgpu_daemon.portid) {
		if (!vgpu_daemon_match_locked(net, portid))
			err = -EBUSY;
	} else {
		vgpu_daemon.net = get_net(net);
		vgpu_daemon.portid = portid;
		*fresh = true;
	}
	spin_unlock(&vgpu_daemon.lock);
	return err;
}

int vgpu_daemon_unregister(struct net *net, u32 portid)
{
	struct net *old = NULL;
	int err = 0;

	spin_lock(&vgpu_daemon.lock);
	if (!vgpu_daemon.portid)
		err = -ENOENT;
	else if (!vgpu_daemon_match_locked(net, portid))
		err = -EPERM;
	else
		old = vgpu_daemon_clear_locked();
	spin_unlock(&vgpu_daemon.lock);
	if (old)
		put_net(old);
	return err;
}

/* The netlink socket @portid in @net is gone; if it was the daemon, drop it. */
void vgpu_daemon_gone(struct net *net, u32 portid)
{
	struct net *old = NULL;

	spin_lock(&vgpu_daemon.lock);
	if (vgpu_daemon_match_locked(net, portid))
		old = vgpu_daemon_clear_locked();
	spin_unlock(&vgpu_daemon.lock);
	if (old) {
		pr_info("vgpu: daemon (port %u) is gone\n", portid);
		put_net(old);
	}
}

/* Is @portid in @net the registered daemon? */
bool vgpu_daemon_is(struct net *net, u32 portid)
{
	bool is;

	spin_lock(&vgpu_daemon.lock);
	is = vgpu_daemon_match_locked(net, portid);
	spin_unlock(&vgpu_daemon.lock);
	return is;
}

u32 vgpu_daemon_portid(void)
{
	return READ_ONCE(vgpu_daemon.portid);
}

/*
 * Returns a referenced net of the daemon and its port, or NULL for none.
 * With @req, makes it pending with that daemon in the same step.
 */
static struct net *vgpu_daemon_get(u32 *portid, struct vgpu_req *req)
{
	struct net *net = NULL;

	spin_lock(&vgpu_daemon.lock);
	if (vgpu_daemon.portid) {
		net = get_net(vgpu_daemon.net);
		*portid = vgpu_daemon.portid;
		if (req)
			hash_add(vgpu_daemon.pending, &req->node, req->id);
	}
	spin_unlock(&vgpu_daemon.lock);
	return net;
}

/*
 * The call got no verdict: apply the fail policy. Returns VGPU_OUT_FORWARD
 * (fail-open) or @err (fail-closed). A POST upcall follows a call that has
 * happened: no policy applies, its caller keeps the driver's results.
 */
static int vgpu_fail_policy(const struct vgpu_req *req, int err)
{
	trace_vgpu_upcall_verdict(req->id, 0, err);
	if (req->kind == VGPU_UPCALL_POST)
		return err;
	if (READ_ONCE(vgpu_fail_open)) {
		vgpu_count(fail_open);
		return VGPU_OUT_FORWARD;
	}
	vgpu_count(fail_closed);
	return err;
}

/* Takes @req out of the table if it is still there. True: the caller owns it. */
static bool vgpu_req_claim(struct vgpu_req *req)
{
	bool owned = false;

	spin_lock(&vgpu_daemon.lock);
	if (hash_hashed(&req->node)) {
		hash_del(&req->node);
		owned = true;
	}
	spin_unlock(&vgpu_daemon.lock);
	return owned;
}

/* The outcome set by whoever completed @req (we did not own it). */
static int vgpu_req_result(struct vgpu_req *req, struct vgpu_upcall_msg *msg,
			   struct vgpu_verdict *v)
{
	if (req->err)
		return vgpu_fail_policy(req, req->err);
	*v = req->verdict;
	msg->replied = req->replied;
	return VGPU_OUT_VERDICT;
}

/* A request for @msg, not yet pending; assigns @msg's id unless set. */
static void vgpu_req_init(struct vgpu_req *req, struct vgpu_upcall_msg *msg)
{
	*req = (struct vgpu_req) {
		.id = msg->hdr.id ? msg->hdr.id :
				    atomic64_inc_return(&vgpu_upcall_ids),
		.kind = msg->hdr.kind,
		.nr = msg->hdr.nr,
		.params_len = msg->params ? msg->params_len : 0,
		.data_len = msg->data ? msg->data_len : 0,
		.reply_params = msg->reply_params,
		.reply_data = msg->reply_data,
		.data2_len = msg->data2 ? msg->data2_len : 0,
		.reply_data2 = msg->reply_data2,
	};
	INIT_HLIST_NODE(&req->node);
	init_completion(&req->done);
	msg->hdr.id = req->id;
	msg->replied = 0;
}

/*
 * The waiter gave up on an upcall the daemon has (it owns @req: no verdict
 * will be taken). Tell the daemon, so that whatever it reserved for the
 * upcall goes back and an OPEN's context is forgotten.
 */
static void vgpu_upcall_abandon(const struct vgpu_upcall_msg *msg,
				const struct vgpu_req *req, int err)
{
	struct vgpu_event ev = {
		.ctx_id = msg->hdr.ctx_id,
		.upcall_id = req->id,
		.kind = VGPU_EVENT_ABANDONED,
		.nr = req->kind,
		.ret = err,
	};

	vgpu_count4(abandoned);
	vgpu_event(&ev, NULL, 0, NULL, 0);
}

/* The upcall could not be sent: no daemon, its socket is gone, no memory. */
static int vgpu_upcall_lost(const struct vgpu_req *req)
{
	vgpu_count(lost);
	return vgpu_fail_policy(req, -EHOSTDOWN);
}

/* vgpu_upcall() once it holds its slots. */
static int vgpu_upcall_slotted(struct vgpu_upcall_msg *msg,
			       struct vgpu_verdict *v)
{
	struct vgpu_req req;
	struct sk_buff *skb;
	struct net *net;
	unsigned long timeout;
	u32 portid = 0;
	long left;
	int err;

	vgpu_req_init(&req, msg);
	if (!vgpu_daemon_portid())
		return vgpu_upcall_lost(&req);
	skb = vgpu_genl_upcall_skb(msg);
	if (!skb)
		return vgpu_upcall_lost(&req);
	/* Pending before sent: the verdict may arrive before send returns. */
	net = vgpu_daemon_get(&portid, &req);
	if (!net) {
		kfree_skb(skb);
		return vgpu_upcall_lost(&req);
	}

	trace_vgpu_upcall_send(req.id, msg->hdr.ctx_id, msg->hdr.kind,
			       msg->hdr.nr);
	err = vgpu_genl_send(net, portid, skb);
	put_net(net);
	if (err) {
		if (!vgpu_req_claim(&req))
			return vgpu_req_result(&req, msg, v);
		return vgpu_upcall_lost(&req);
	}
	vgpu_count(upcalls);

	timeout = msecs_to_jiffies(READ_ONCE(vgpu_upcall_timeout_ms));
	left = wait_for_completion_killable_timeout(&req.done, timeout);
	/*
	 * Completed by someone else: they unlinked @req and called complete()
	 * under the lock that vgpu_req_claim() has since taken, so nobody
	 * touches @req any more and its outcome is set.
	 */
	if (!vgpu_req_claim(&req))
		return vgpu_req_result(&req, msg, v);
	if (left < 0) {
		vgpu_count(killed);
		trace_vgpu_upcall_verdict(req.id, 0, -EINTR);
		vgpu_upcall_abandon(msg, &req, -EINTR);
		return -EINTR;
	}
	vgpu_count(timeouts);
	vgpu_upcall_abandon(msg, &req, -ETIMEDOUT);
	return vgpu_fail_policy(&req, -ETIMEDOUT);
}

/**
 * vgpu_upcall - send an upcall and wait for its verdict
 * @msg: the upcall; @msg->hdr.id is assigned here unless set (a POST upcall
 *	keeps the id of the IOCTL upcall it follows: that one has left the
 *	pending table, so one id is never pending twice); @msg->reply_*
 *	receive a REPLY's blocks and @msg->replied says which
 * @v: the verdict, when VGPU_OUT_VERDICT is returned
 *
 * First takes a slot of @msg->ctx, of its opener and of the module,
 * waiting (killable, counted as throttled) while one of them has none
 * free; every slot holder's upcall completes within upcall_timeout_ms, so
 * the wait ends. Then sleeps killable for at most upcall_timeout_ms. Errors of the fail-closed
 * policy: -EHOSTDOWN when no daemon is registered, its socket is gone or
 * the upcall could not be sent; -ETIMEDOUT when no verdict came in time.
 * A fatal signal returns -EINTR (while waiting for a slot too: nothing
 * was sent). A POST upcall returns these errors
 * whatever the policy.
 *
 * Return: VGPU_OUT_VERDICT, VGPU_OUT_FORWARD or a negative errno.
 */
int vgpu_upcall(struct vgpu_upcall_msg *msg, struct vgpu_verdict *v)
{
	int ret;

	ret = vgpu_slots_get(msg->ctx);
	if (ret) {
		vgpu_count(killed);
		return ret;
	}
	ret = vgpu_upcall_slotted(msg, v);
	vgpu_slots_put(msg->ctx);
	return ret;
}

/* Checks of a verdict on its own, before its upcall is looked up. */
static int vgpu_verdict_check(const struct vgpu_verdict *v,
			      const struct vgpu_blocks *b, const char **why)
{
	if (v->reserved) {
		*why = "verdict reserved must be 0";
		return -EINVAL;
	}
	if (v->flags & ~(VGPU_VERDICT_F_POST | VGPU_VERDICT_F_SCHED_OFF)) {
		*why = "unknown verdict flags";
		return -EINVAL;
	}
	if (v->flags && v->action != VGPU_VERDICT_ALLOW) {
		*why = "verdict flags need the action ALLOW";
		return -EINVAL;
	}
	switch (v->action) {
	case VGPU_VERDICT_ALLOW:
	case VGPU_VERDICT_FAIL_STATUS:
	case VGPU_VERDICT_REPLY:
		if (v->error) {
			*why = "error must be 0 unless the action is DENY";
			return -EINVAL;
		}
		break;
	case VGPU_VERDICT_DENY:
		if (v->error < 1 || v->error > VGPU_ERRNO_MAX) {
			*why = "DENY error must be in 1..511";
			return -EINVAL;
		}
		break;
	default:
		*why = "unknown verdict action";
		return -EINVAL;
	}
	if (v->action == VGPU_VERDICT_REPLY && !b->params && !b->data &&
	    !b->data2) {
		*why = "REPLY carries no PARAMS, DATA or DATA2";
		return -EINVAL;
	}
	if (v->action != VGPU_VERDICT_REPLY && (b->data || b->data2)) {
		*why = "only a REPLY verdict carries DATA or DATA2";
		return -EINVAL;
	}
	if (v->action != VGPU_VERDICT_REPLY &&
	    v->action != VGPU_VERDICT_ALLOW && b->params) {
		*why = "only a REPLY or ALLOW verdict carries PARAMS";
		return -EINVAL;
	}
	return 0;
}

/* Does @v fit the upcall @req? Caller holds vgpu_daemon.lock. */
static int vgpu_verdict_fits(const struct vgpu_req *req,
			     const struct vgpu_verdict *v,
			     const struct vgpu_blocks *b, const char **why)
{
	switch (v->action) {
	case VGPU_VERDICT_ALLOW:
		if ((v->flags & VGPU_VERDICT_F_POST) &&
		    req->kind != VGPU_UPCALL_IOCTL) {
			*why = "VGPU_VERDICT_F_POST only answers an IOCTL upcall";
			return -EINVAL;
		}
		if ((v->flags & VGPU_VERDICT_F_SCHED_OFF) &&
		    (req->kind != VGPU_UPCALL_IOCTL ||
		     !vgpu_sched_alloc_layout(req->nr, req->params_len))) {
			*why = "VGPU_VERDICT_F_SCHED_OFF needs an RM_ALLOC upcall";
			return -EINVAL;
		}
		/* v5: the params the driver reads instead of the checked ones. */
		if (b->params && (req->kind != VGPU_UPCALL_IOCTL ||
				  !req->params_len || !req->reply_params ||
				  b->params_len != req->params_len)) {
			*why = "ALLOW PARAMS answer an IOCTL upcall, as long as its PARAMS";
			return -EINVAL;
		}
		return 0;
	case VGPU_VERDICT_DENY:
		if (req->kind == VGPU_UPCALL_POST) {
			*why = "a POST upcall is answered by ALLOW, REPLY or FAIL_STATUS";
			return -EINVAL;
		}
		return 0;
	case VGPU_VERDICT_FAIL_STATUS:
		/* v4: a POST upcall too (the daemon undid the call). */
		if (req->kind != VGPU_UPCALL_IOCTL &&
		    req->kind != VGPU_UPCALL_POST) {
			*why = "FAIL_STATUS only answers an IOCTL or POST upcall";
			return -EINVAL;
		}
		if (req->params_len < sizeof(u32) ||
		    v->status_off > req->params_len - sizeof(u32)) {
			*why = "FAIL_STATUS status_off + 4 exceeds the params size";
			return -EINVAL;
		}
		return 0;
	case VGPU_VERDICT_REPLY:
		if (req->kind != VGPU_UPCALL_IOCTL &&
		    req->kind != VGPU_UPCALL_POST) {
			*why = "REPLY only answers an IOCTL or POST upcall";
			return -EINVAL;
		}
		if (b->params && (!req->params_len || !req->reply_params ||
				  b->params_len != req->params_len)) {
			*why = "REPLY PARAMS must be as long as the PARAMS sent";
			return -EINVAL;
		}
		if (b->data && (!req->data_len || !req->reply_data ||
				b->data_len != req->data_len)) {
			*why = "REPLY DATA must be as long as the DATA sent";
			return -EINVAL;
		}
		if (b->data2 && (!req->data2_len || !req->reply_data2 ||
				 b->data2_len != req->data2_len)) {
			*why = "REPLY DATA2 must be as long as the DATA2 sent";
			return -EINVAL;
		}
		return 0;
	default:
		return -EINVAL;	/* unreachable: vgpu_verdict_check() */
	}
}

/*
 * Takes @req out of the table and completes it with the daemon's answer,
 * copying a REPLY's blocks into the waiter's buffers. Caller holds
 * vgpu_daemon.lock and found @req pending: unlinking it makes this the
 * owner of its outcome.
 */
static void vgpu_req_answer_locked(struct vgpu_req *req,
				   const struct vgpu_verdict *v,
				   const struct vgpu_blocks *b)
{
	hash_del(&req->node);
	req->replied = 0;
	if (b->params) {
		memcpy(req->reply_params, b->params, b->params_len);
		req->replied |= VGPU_REPLIED_PARAMS;
	}
	if (b->data) {
		memcpy(req->reply_data, b->data, b->data_len);
		req->replied |= VGPU_REPLIED_DATA;
	}
	if (b->data2) {
		memcpy(req->reply_data2, b->data2, b->data2_len);
		req->replied |= VGPU_REPLIED_DATA2;
	}
	req->verdict = *v;
	req->err = 0;
	complete(&req->done);
}

/**
 * vgpu_verdict - apply a verdict from the daemon
 * @net: the sender's net
 * @portid: the sender's port
 * @v: the verdict
 * @b: the blocks of a REPLY (pointers into the message, NULL when absent)
 * @why: set to a message for the sender on error
 *
 * A REPLY's blocks are copied into the buffers the waiter allocated before
 * sending, under the lock and only while the request is pending, so the
 * waiter sees them complete or not at all.
 *
 * Return: 0; -EPERM when the sender is not the registered daemon; -EINVAL
 * for a malformed verdict (the waiter is untouched); -ENOENT when the
 * upcall is unknown or already complete.
 */
int vgpu_verdict(struct net *net, u32 portid, const struct vgpu_verdict *v,
		 const struct vgpu_blocks *b, const char **why)
{
	struct vgpu_req *req;
	int err;

	err = vgpu_verdict_check(v, b, why);

	spin_lock(&vgpu_daemon.lock);
	if (!vgpu_daemon_match_locked(net, portid)) {
		spin_unlock(&vgpu_daemon.lock);
		*why = "sender is not the registered daemon";
		return -EPERM;
	}
	if (err)
		goto bad;
	req = vgpu_pending_find_locked(v->id);
	if (!req) {
		spin_unlock(&vgpu_daemon.lock);
		vgpu_count(lost);
		*why = "no such pending upcall (completed, timed out or unknown)";
		return -ENOENT;
	}
	err = vgpu_verdict_fits(req, v, b, why);
	if (err)
		goto bad;
	vgpu_req_answer_locked(req, v, b);
	spin_unlock(&vgpu_daemon.lock);

	vgpu_count(verdicts);
	trace_vgpu_upcall_verdict(v->id, v->action,
				  v->action == VGPU_VERDICT_DENY ? v->error :
				  v->status);
	return 0;
bad:
	spin_unlock(&vgpu_daemon.lock);
	vgpu_count(bad_verdicts);
	return err;
}

/**
 * vgpu_event - send an event to the daemon without blocking
 * @ev: the event header
 * @params: params to attach, or NULL
 * @plen: their length
 * @data: data to attach, or NULL
 * @dlen: its length
 *
 * Nothing is sent (and nothing counted) when no daemon is registered.
 */
void vgpu_event(const struct vgpu_event *ev, const void *params, u32 plen,
		const void *data, u32 dlen)
{
	struct sk_buff *skb;
	struct net *net;
	u32 portid;

	net = vgpu_daemon_get(&portid, NULL);
	if (!net)
		return;
	skb = vgpu_genl_event_skb(ev, params, plen, data, dlen);
	if (skb && !vgpu_genl_send(net, portid, skb))
		vgpu_count(events);
	else
		vgpu_count(events_lost);
	put_net(net);
}

/* Module exit: no file is open, so nothing waits; drop the daemon. */
void vgpu_upcall_exit(void)
{
	struct net *old;

	spin_lock(&vgpu_daemon.lock);
	old = vgpu_daemon_clear_locked();
	spin_unlock(&vgpu_daemon.lock);
	if (old)
		put_net(old);
}
