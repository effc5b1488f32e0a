// SPDX-License-Identifier: GPL-2.0
/*
 * The generic netlink family "vgpu": daemon -> kernel commands, kernel ->
 * daemon upcalls and events, and the notifier that sees the daemon go.
 */
#include <linux/netlink.h>
#include <linux/notifier.h>
#include <linux/pid_namespace.h>
#include <linux/sched.h>
#include <linux/stringify.h>
#include <net/genetlink.h>
#include <net/netlink.h>

#include "vgpu.h"

static const struct nla_policy vgpu_nl_policy[VGPU_A_MAX + 1] = {
	[VGPU_A_VERSION]	= { .type = NLA_U32 },
	[VGPU_A_FILTER_FLAGS]	= NLA_POLICY_MASK(NLA_U32, VGPU_FILTER_OPEN |
						  VGPU_FILTER_UVM_MMAP),
	[VGPU_A_RULES]		= { .type = NLA_BINARY,
				    .len = VGPU_RULES_MAX *
					   sizeof(struct vgpu_rule) },
	[VGPU_A_STATS]		= NLA_POLICY_EXACT_LEN(sizeof(struct vgpu_stats)),
	[VGPU_A_UPCALL]		= NLA_POLICY_EXACT_LEN(sizeof(struct vgpu_upcall)),
	[VGPU_A_PARAMS]		= { .type = NLA_BINARY, .len = VGPU_PARAMS_MAX },
	[VGPU_A_DATA]		= { .type = NLA_BINARY, .len = VGPU_PARAMS_MAX },
	[VGPU_A_CGROUP]		= { .type = NLA_NUL_STRING, .len = PATH_MAX - 1 },
	[VGPU_A_VERDICT]	= NLA_POLICY_EXACT_LEN(sizeof(struct vgpu_verdict)),
	[VGPU_A_EVENT]		= NLA_POLICY_EXACT_LEN(sizeof(struct vgpu_event)),
	[VGPU_A_CURSOR]		= { .type = NLA_U64 },
	/* Sized by vgpu_nl_schedule(), so that every bad size is -EINVAL. */
	[VGPU_A_SCHED]		= { .type = NLA_BINARY },
	[VGPU_A_NESTED]		= { .type = NLA_BINARY,
				    .len = VGPU_RULES_MAX *
					   sizeof(struct vgpu_rule_nested) },
	[VGPU_A_DATA2]		= { .type = NLA_BINARY, .len = VGPU_PARAMS_MAX },
	/* Sized by vgpu_nl_object(). */
	[VGPU_A_OBJ]		= { .type = NLA_BINARY },
};

static struct genl_family vgpu_genl_family;

/* Like NL_SET_ERR_MSG_ATTR, for a message chosen at run time. @msg is static. */
static void vgpu_extack(struct netlink_ext_ack *extack,
			const struct nlattr *attr, const char *msg)
{
	if (!extack)
		return;
	extack->_msg = msg;
	extack->bad_attr = attr;
}

/*
 * Who may send what. Every command needs CAP_NET_ADMIN in the initial user
 * namespace (GENL_ADMIN_PERM, checked by genetlink for both the socket's
 * opener and the sender). On top of that:
 *
 * - only the registered daemon changes what the module enforces (SET_FILTER,
 *   VERDICT, UNREGISTER, SCHEDULE, OBJECT);
 * - only a sender in the initial pid namespace becomes the daemon
 *   (REGISTER), so that a container granted CAP_NET_ADMIN with the host's
 *   network cannot take the daemon's place while it restarts;
 * - the module's counters and contexts (GET_STATS, LIST_CONTEXTS) are for
 *   the daemon and for the host's operator (vgpuctl module-stats and
 *   module-contexts, which work while no daemon runs).
 *
 * A doit handler runs in the sending task's context (netlink_unicast() into
 * a kernel socket calls it synchronously), so current is the sender.
 */
static bool vgpu_sender_in_init_pid_ns(void)
{
	return task_active_pid_ns(current) == &init_pid_ns;
}

/* The family is not netns-aware: every sender is in init_net. */
static bool vgpu_sender_is_daemon(struct genl_info *info)
{
	return vgpu_daemon_is(genl_info_net(info), info->snd_portid);
}

/* For GET_STATS and LIST_CONTEXTS: the daemon, or the host. */
static int vgpu_may_read(struct genl_info *info)
{
	if (vgpu_sender_is_daemon(info) || vgpu_sender_in_init_pid_ns())
		return 0;
	NL_SET_ERR_MSG(info->extack,
		       "vgpu: the module is read by the daemon or from the initial pid namespace only");
	return -EPERM;
}

static int vgpu_nl_register(struct sk_buff *skb, struct genl_info *info)
{
	u32 version, restored;
	bool fresh;
	int err;

	if (!vgpu_sender_in_init_pid_ns()) {
		NL_SET_ERR_MSG(info->extack,
			       "vgpu: REGISTER is for the initial pid namespace only");
		return -EPERM;
	}
	if (GENL_REQ_ATTR_CHECK(info, VGPU_A_VERSION))
		return -EINVAL;
	version = nla_get_u32(info->attrs[VGPU_A_VERSION]);
	if (version != VGPU_PROTO_VERSION) {
#ifdef NL_SET_ERR_MSG_FMT
		NL_SET_ERR_MSG_FMT(info->extack,
				   "vgpu: daemon speaks protocol version %u, module speaks %u",
				   version, VGPU_PROTO_VERSION);
#else
		NL_SET_ERR_MSG_ATTR(info->extack, info->attrs[VGPU_A_VERSION],
				    "vgpu: unsupported protocol version (attribute VERSION); module speaks version "
				    __stringify(VGPU_PROTO_VERSION));
#endif
		pr_notice_ratelimited("vgpu: daemon protocol version %u refused, module speaks %u\n",
				      version, VGPU_PROTO_VERSION);
		return -EPROTONOSUPPORT;
	}
	err = vgpu_daemon_register(genl_info_net(info), info->snd_portid,
				   &fresh);
	if (err == -EBUSY) {
		NL_SET_ERR_MSG(info->extack,
			       "vgpu: another daemon is registered");
		return err;
	}
	if (err || !fresh)
		return err;
	pr_info("vgpu: daemon registered (port %u)\n", info->snd_portid);
	/* In the new daemon's process: what a gone daemon left off goes on. */
	restored = vgpu_sched_restore();
	if (restored)
		pr_info("vgpu: %u channel groups left off by the previous daemon turned back on\n",
			restored);
	return 0;
}

static int vgpu_nl_unregister(struct sk_buff *skb, struct genl_info *info)
{
	int err;

	err = vgpu_daemon_unregister(genl_info_net(info), info->snd_portid);
	if (err == -EPERM)
		NL_SET_ERR_MSG(info->extack,
			       "vgpu: sender is not the registered daemon");
	else if (err == -ENOENT)
		NL_SET_ERR_MSG(info->extack, "vgpu: no daemon is registered");
	return err;
}

static int vgpu_nl_set_filter(struct sk_buff *skb, struct genl_info *info)
{
	const struct nlattr *rules = info->attrs[VGPU_A_RULES];
	const struct nlattr *nested = info->attrs[VGPU_A_NESTED];
	const char *why = NULL;
	u32 flags = 0, n = 0, nn = 0;
	int err;

	if (!vgpu_sender_is_daemon(info)) {
		NL_SET_ERR_MSG(info->extack,
			       "vgpu: SET_FILTER is for the registered daemon only");
		return -EPERM;
	}
	if (info->attrs[VGPU_A_FILTER_FLAGS])
		flags = nla_get_u32(info->attrs[VGPU_A_FILTER_FLAGS]);
	if (rules) {
		if (nla_len(rules) % sizeof(struct vgpu_rule)) {
			NL_SET_ERR_MSG_ATTR(info->extack, rules,
					    "vgpu: RULES length is not a multiple of struct vgpu_rule");
			return -EINVAL;
		}
		n = nla_len(rules) / sizeof(struct vgpu_rule);
	}
	if (nested) {
		if (nla_len(nested) % sizeof(struct vgpu_rule_nested)) {
			NL_SET_ERR_MSG_ATTR(info->extack, nested,
					    "vgpu: NESTED length is not a multiple of struct vgpu_rule_nested");
			return -EINVAL;
		}
		nn = nla_len(nested) / sizeof(struct vgpu_rule_nested);
	}
	err = vgpu_filter_set(flags, rules ? nla_data(rules) : NULL, n,
			      nested ? nla_data(nested) : NULL, nn, &why);
	if (err && why)
		vgpu_extack(info->extack, nested && strstr(why, "nested") ?
			    nested : rules, why);
	return err;
}

/*
 * struct vgpu_counters lists the u64 counters of struct vgpu_stats, from
 * @contexts on, in the same order: sum each CPU's copy into them.
 */
static void vgpu_stats_fill(struct vgpu_stats *s)
{
	u64 *out = &s->contexts;
	unsigned int i;
	int cpu;

	BUILD_BUG_ON(sizeof(struct vgpu_counters) !=
		     sizeof(*s) - offsetof(struct vgpu_stats, contexts));
	BUILD_BUG_ON(offsetof(struct vgpu_stats, mmaps) -
		     offsetof(struct vgpu_stats, contexts) !=
		     offsetof(struct vgpu_counters, mmaps));
	memset(s, 0, sizeof(*s));
	s->version = VGPU_PROTO_VERSION;
	s->daemon_portid = vgpu_daemon_portid();
	for_each_possible_cpu(cpu) {
		const u64 *c = (const u64 *)per_cpu_ptr(&vgpu_counters, cpu);

		for (i = 0; i < sizeof(struct vgpu_counters) / sizeof(u64); i++)
			out[i] += READ_ONCE(c[i]);
	}
}

/* The same for struct vgpu_counters4 and struct vgpu_stats4 from @abandoned. */
static void vgpu_stats4_fill(struct vgpu_stats4 *s)
{
	u64 *out = &s->abandoned;
	unsigned int i;
	int cpu;

	BUILD_BUG_ON(sizeof(struct vgpu_counters4) !=
		     offsetof(struct vgpu_stats4, reserved));
	BUILD_BUG_ON(offsetof(struct vgpu_stats4, throttled) !=
		     offsetof(struct vgpu_counters4, throttled));
	memset(s, 0, sizeof(*s));
	for_each_possible_cpu(cpu) {
		const u64 *c = (const u64 *)per_cpu_ptr(&vgpu_counters4, cpu);

		for (i = 0; i < sizeof(struct vgpu_counters4) / sizeof(u64); i++)
			out[i] += READ_ONCE(c[i]);
	}
}

static int vgpu_nl_get_stats(struct sk_buff *skb, struct genl_info *info)
{
	struct vgpu_stats4 stats4;
	struct vgpu_stats stats;
	struct sk_buff *msg;
	void *hdr;
	int err;

	err = vgpu_may_read(info);
	if (err)
		return err;
	msg = genlmsg_new(nla_total_size(sizeof(stats)) +
			  nla_total_size(sizeof(stats4)), GFP_KERNEL);
	if (!msg)
		return -ENOMEM;
	hdr = genlmsg_put_reply(msg, info, &vgpu_genl_family, 0,
				VGPU_CMD_GET_STATS);
	if (!hdr)
		goto nospace;
	vgpu_stats_fill(&stats);
	vgpu_stats4_fill(&stats4);
	stats4.objects = vgpu_objects_run();
	if (nla_put(msg, VGPU_A_STATS, sizeof(stats), &stats) ||
	    nla_put(msg, VGPU_A_STATS4, sizeof(stats4), &stats4))
		goto nospace;
	genlmsg_end(msg, hdr);
	return genlmsg_reply(msg, info);
nospace:
	nlmsg_free(msg);
	return -EMSGSIZE;
}

/*
 * VERDICT: the header, and for a REPLY the blocks. The blocks stay in the
 * message; vgpu_verdict() copies them into the waiter's buffers.
 */
static int vgpu_nl_verdict(struct sk_buff *skb, struct genl_info *info)
{
	const struct nlattr *params = info->attrs[VGPU_A_PARAMS];
	const struct nlattr *data = info->attrs[VGPU_A_DATA];
	const struct nlattr *data2 = info->attrs[VGPU_A_DATA2];
	struct vgpu_blocks b = {};
	struct vgpu_verdict v;
	const char *why = NULL;
	int err;

	if (GENL_REQ_ATTR_CHECK(info, VGPU_A_VERDICT))
		return -EINVAL;
	memcpy(&v, nla_data(info->attrs[VGPU_A_VERDICT]), sizeof(v));
	if (params) {
		b.params = nla_data(params);
		b.params_len = nla_len(params);
	}
	if (data) {
		b.data = nla_data(data);
		b.data_len = nla_len(data);
	}
	if (data2) {
		b.data2 = nla_data(data2);
		b.data2_len = nla_len(data2);
	}
	err = vgpu_verdict(genl_info_net(info), info->snd_portid, &v, &b, &why);
	if (err && why)
		vgpu_extack(info->extack, info->attrs[VGPU_A_VERDICT], why);
	return err;
}

static int vgpu_nl_list_contexts(struct sk_buff *skb, struct genl_info *info)
{
	const struct nlattr *cursor = info->attrs[VGPU_A_CURSOR];
	struct vgpu_opener *openers;
	struct vgpu_context *ctxs;
	struct sk_buff *msg;
	u64 start = 0, next;
	int err;
	void *hdr;
	u32 n;

	/* Each reply fits one attribute (nla_len is 16 bits). */
	BUILD_BUG_ON(nla_total_size(VGPU_LIST_MAX * sizeof(*ctxs)) > U16_MAX);
	BUILD_BUG_ON(nla_total_size(VGPU_LIST_MAX * sizeof(*openers)) > U16_MAX);
	BUILD_BUG_ON(nla_total_size(VGPU_SCHED_MAX *
				    sizeof(struct vgpu_sched_result)) > U16_MAX);
	BUILD_BUG_ON(nla_total_size(VGPU_OBJ_MAX *
				    sizeof(struct vgpu_obj_result)) > U16_MAX);
	err = vgpu_may_read(info);
	if (err)
		return err;
	err = -EMSGSIZE;
	if (cursor)
		start = nla_get_u64(cursor);
	ctxs = kvmalloc_array(VGPU_LIST_MAX, sizeof(*ctxs), GFP_KERNEL);
	if (!ctxs)
		return -ENOMEM;
	openers = kvmalloc_array(VGPU_LIST_MAX, sizeof(*openers), GFP_KERNEL);
	if (!openers) {
		err = -ENOMEM;
		goto out_ctxs;
	}
	n = vgpu_ctx_list(start, ctxs, openers, VGPU_LIST_MAX, &next);
	msg = genlmsg_new(nla_total_size(n * sizeof(*ctxs)) +
			  nla_total_size(n * sizeof(*openers)) +
			  nla_total_size(sizeof(next)), GFP_KERNEL);
	if (!msg) {
		err = -ENOMEM;
		goto out_openers;
	}
	hdr = genlmsg_put_reply(msg, info, &vgpu_genl_family, 0,
				VGPU_CMD_LIST_CONTEXTS);
	if (!hdr)
		goto out_msg;
	if (nla_put(msg, VGPU_A_CONTEXTS, n * sizeof(*ctxs), ctxs) ||
	    nla_put(msg, VGPU_A_OPENERS, n * sizeof(*openers), openers) ||
	    nla_put(msg, VGPU_A_CURSOR, sizeof(next), &next))
		goto out_msg;
	genlmsg_end(msg, hdr);
	kvfree(openers);
	kvfree(ctxs);
	return genlmsg_reply(msg, info);

out_msg:
	nlmsg_free(msg);
out_openers:
	kvfree(openers);
out_ctxs:
	kvfree(ctxs);
	return err;
}

/*
 * A batch command of the daemon's (SCHEDULE, OBJECT): 1 to @max structs of
 * @in_size in attribute @in_attr, answered by as many structs of @res_size
 * in @res_attr, which @run fills.
 */
struct vgpu_batch {
	u8 cmd;
	u16 in_attr;
	u16 res_attr;
	size_t in_size;
	size_t res_size;
	u32 max;
	const char *not_daemon;	/* static extack messages */
	const char *bad_len;
	int (*run)(const void *in, u32 n, void *res, const char **why);
};

static int vgpu_nl_batch(const struct vgpu_batch *b, struct genl_info *info)
{
	const struct nlattr *attr = info->attrs[b->in_attr];
	const char *why = NULL;
	struct sk_buff *msg;
	void *in, *res;
	void *hdr;
	int err;
	u32 n;

	if (!vgpu_sender_is_daemon(info)) {
		vgpu_extack(info->extack, NULL, b->not_daemon);
		return -EPERM;
	}
	if (GENL_REQ_ATTR_CHECK(info, b->in_attr))
		return -EINVAL;
	n = nla_len(attr) / b->in_size;
	if (nla_len(attr) % b->in_size || !n || n > b->max) {
		vgpu_extack(info->extack, attr, b->bad_len);
		return -EINVAL;
	}
	/* A copy: the attribute is only 4-byte aligned, the structs have u64s. */
	in = kmemdup(nla_data(attr), nla_len(attr), GFP_KERNEL);
	if (!in)
		return -ENOMEM;
	res = kcalloc(n, b->res_size, GFP_KERNEL);
	if (!res) {
		err = -ENOMEM;
		goto out_in;
	}
	msg = genlmsg_new(nla_total_size(n * b->res_size), GFP_KERNEL);
	if (!msg) {
		err = -ENOMEM;
		goto out_res;
	}
	hdr = genlmsg_put_reply(msg, info, &vgpu_genl_family, 0, b->cmd);
	if (!hdr) {
		err = -EMSGSIZE;
		goto out_msg;
	}
	err = b->run(in, n, res, &why);
	if (err) {
		if (why)
			vgpu_extack(info->extack, attr, why);
		goto out_msg;
	}
	if (nla_put(msg, b->res_attr, n * b->res_size, res)) {
		err = -EMSGSIZE;
		goto out_msg;
	}
	genlmsg_end(msg, hdr);
	kfree(res);
	kfree(in);
	return genlmsg_reply(msg, info);

out_msg:
	nlmsg_free(msg);
out_res:
	kfree(res);
out_in:
	kfree(in);
	return err;
}

static int vgpu_run_schedule(const void *in, u32 n, void *res, const char **why)
{
	return vgpu_schedule(in, n, res, why);
}

static int vgpu_nl_schedule(struct sk_buff *skb, struct genl_info *info)
{
	static const struct vgpu_batch b = {
		.cmd = VGPU_CMD_SCHEDULE,
		.in_attr = VGPU_A_SCHED,
		.res_attr = VGPU_A_SCHED_RESULT,
		.in_size = sizeof(struct vgpu_sched),
		.res_size = sizeof(struct vgpu_sched_result),
		.max = VGPU_SCHED_MAX,
		.not_daemon = "vgpu: SCHEDULE is for the registered daemon only",
		.bad_len = "vgpu: SCHED must hold 1 to VGPU_SCHED_MAX struct vgpu_sched",
		.run = vgpu_run_schedule,
	};

	return vgpu_nl_batch(&b, info);
}

static int vgpu_run_object(const void *in, u32 n, void *res, const char **why)
{
	return vgpu_object(in, n, res, why);
}

/* OBJECT: the driver's truth about objects (object.c). */
static int vgpu_nl_object(struct sk_buff *skb, struct genl_info *info)
{
	static const struct vgpu_batch b = {
		.cmd = VGPU_CMD_OBJECT,
		.in_attr = VGPU_A_OBJ,
		.res_attr = VGPU_A_OBJ_RESULT,
		.in_size = sizeof(struct vgpu_obj_op),
		.res_size = sizeof(struct vgpu_obj_result),
		.max = VGPU_OBJ_MAX,
		.not_daemon = "vgpu: OBJECT is for the registered daemon only",
		.bad_len = "vgpu: OBJ must hold 1 to VGPU_OBJ_MAX struct vgpu_obj_op",
		.run = vgpu_run_object,
	};

	return vgpu_nl_batch(&b, info);
}

static const struct genl_small_ops vgpu_nl_ops[] = {
	{
		.cmd	= VGPU_CMD_REGISTER,
		.doit	= vgpu_nl_register,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_SET_FILTER,
		.doit	= vgpu_nl_set_filter,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_GET_STATS,
		.doit	= vgpu_nl_get_stats,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_VERDICT,
		.doit	= vgpu_nl_verdict,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_UNREGISTER,
		.doit	= vgpu_nl_unregister,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_LIST_CONTEXTS,
		.doit	= vgpu_nl_list_contexts,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_SCHEDULE,
		.doit	= vgpu_nl_schedule,
		.flags	= GENL_ADMIN_PERM,
	},
	{
		.cmd	= VGPU_CMD_OBJECT,
		.doit	= vgpu_nl_object,
		.flags	= GENL_ADMIN_PERM,
	},
};

static struct genl_family vgpu_genl_family = {
	.name		= VGPU_GENL_NAME,
	.version	= VGPU_GENL_VERSION,
	.maxattr	= VGPU_A_MAX,
	.policy		= vgpu_nl_policy,
	.parallel_ops	= true,
	.module		= THIS_MODULE,
	.small_ops	= vgpu_nl_ops,
	.n_small_ops	= ARRAY_SIZE(vgpu_nl_ops),
};

/*
 * Builds a kernel -> daemon message: the attribute @type holding @hlen
 * bytes at @head, then PARAMS, DATA and DATA2 when @b has them, then the cgroup
 * path and the opener when given. Return: the message, or NULL when out of
 * memory.
 */
static struct sk_buff *vgpu_genl_msg(u8 cmd, int type, const void *head,
				     size_t hlen, const struct vgpu_blocks *b,
				     const char *cgroup,
				     const struct vgpu_opener *opener)
{
	size_t cglen = cgroup ? strlen(cgroup) + 1 : 0;
	struct sk_buff *skb;
	void *hdr;

	skb = genlmsg_new(nla_total_size(hlen) +
			  nla_total_size(b->params_len) +
			  nla_total_size(b->data_len) +
			  nla_total_size(b->data2_len) +
			  nla_total_size(cglen) +
			  nla_total_size(sizeof(*opener)), GFP_KERNEL);
	if (!skb)
		return NULL;
	hdr = genlmsg_put(skb, 0, 0, &vgpu_genl_family, 0, cmd);
	if (!hdr || nla_put(skb, type, hlen, head) ||
	    (b->params &&
	     nla_put(skb, VGPU_A_PARAMS, b->params_len, b->params)) ||
	    (b->data && nla_put(skb, VGPU_A_DATA, b->data_len, b->data)) ||
	    (b->data2 &&
	     nla_put(skb, VGPU_A_DATA2, b->data2_len, b->data2)) ||
	    (cgroup && nla_put_string(skb, VGPU_A_CGROUP, cgroup)) ||
	    (opener &&
	     nla_put(skb, VGPU_A_OPENER, sizeof(*opener), opener))) {
		nlmsg_free(skb);
		return NULL;
	}
	genlmsg_end(skb, hdr);
	return skb;
}

struct sk_buff *vgpu_genl_upcall_skb(const struct vgpu_upcall_msg *m)
{
	struct vgpu_blocks b = {
		.params = m->params,
		.params_len = m->params_len,
		.data = m->data,
		.data_len = m->data_len,
		.data2 = m->data2,
		.data2_len = m->data2_len,
	};

	return vgpu_genl_msg(VGPU_CMD_UPCALL, VGPU_A_UPCALL, &m->hdr,
			     sizeof(m->hdr), &b, m->cgroup, m->opener);
}

struct sk_buff *vgpu_genl_event_skb(const struct vgpu_event *ev,
				    const void *params, u32 plen,
				    const void *data, u32 dlen)
{
	struct vgpu_blocks b = {
		.params = params,
		.params_len = plen,
		.data = data,
		.data_len = dlen,
	};

	return vgpu_genl_msg(VGPU_CMD_EVENT, VGPU_A_EVENT, ev, sizeof(*ev), &b,
			     NULL, NULL);
}

/* Consumes @skb. Never blocks: a full receive queue is an error. */
int vgpu_genl_send(struct net *net, u32 portid, struct sk_buff *skb)
{
	return genlmsg_unicast(net, skb, portid);
}

static int vgpu_nl_notify(struct notifier_block *nb, unsigned long state,
			  void *ptr)
{
	struct netlink_notify *n = ptr;

	if (state == NETLINK_URELEASE && n->protocol == NETLINK_GENERIC &&
	    n->portid)
		vgpu_daemon_gone(n->net, n->portid);
	return NOTIFY_DONE;
}

static struct notifier_block vgpu_nl_notifier = {
	.notifier_call = vgpu_nl_notify,
};

int vgpu_genl_init(void)
{
	int err;

	err = netlink_register_notifier(&vgpu_nl_notifier);
	if (err)
		return err;
	err = genl_register_family(&vgpu_genl_family);
	if (err)
		goto err_notifier;
	return 0;

err_notifier:
	netlink_unregister_notifier(&vgpu_nl_notifier);
	return err;
}

/*
 * Undoes vgpu_genl_init(). With the family goes the daemon's way in: no
 * daemon can register any more, nor a SCHEDULE record a group turned off,
 * so what they left is dropped too (no emulated file is open by now, so no
 * upcall waits).
 */
void vgpu_genl_exit(void)
{
	genl_unregister_family(&vgpu_genl_family);
	netlink_unregister_notifier(&vgpu_nl_notifier);
	vgpu_sched_exit();
	vgpu_upcall_exit();
}
