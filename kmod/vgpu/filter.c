// SPDX-License-Identifier: GPL-2.0
/*
 * The filter: the daemon's rules (VGPU_CMD_SET_FILTER) that select the
 * calls going the slow path, and the per-node bitmap of escape numbers that
 * lets the fast path skip every other call with one bit test.
 *
 * The filter is immutable once published behind an RCU pointer: a swap
 * never blocks callers, and readers never take a lock.
 */
#include <linux/bitmap.h>
#include <linux/mutex.h>
#include <linux/rcupdate.h>
#include <linux/slab.h>
#include "compat.h"

#include "vgpu.h"

#define VGPU_NODE_MASK_ALL	(BIT(VGPU_NODE_CTL) | BIT(VGPU_NODE_GPU) | \
				 BIT(VGPU_NODE_UVM))

/**
 * struct vgpu_filter - the daemon's selection of slow-path calls; immutable
 * @flags: VGPU_FILTER_*
 * @n_rules: entries in @rules
 * @nr_map: per node kind, bit (nr & 0xff) set when some rule may match
 * @rcu: for kfree_rcu after a swap
 * @nested: per rule, its nested list; @elem_size 0 when it has none
 * @rules: the rules, in the daemon's order (first match wins)
 */
struct vgpu_filter {
	u32 flags;
	u32 n_rules;
	DECLARE_BITMAP(nr_map[VGPU_NODE_KINDS], 256);
	struct rcu_head rcu;
	struct vgpu_rule_nested nested[VGPU_RULES_MAX];
	struct vgpu_rule rules[];
};

/* Serializes writers of vgpu_filter and vgpu_hot; readers use RCU. */
static DEFINE_MUTEX(vgpu_filter_mutex);

/* The current filter, NULL for none. Written under vgpu_filter_mutex. */
static struct vgpu_filter __rcu *vgpu_filter;

/*
 * Per node kind, the escape numbers (low 8 bits) that need more than a plain
 * forward: those some rule of the filter names, IOCTL_XFER_CMD and the
 * fd-bearing escapes. The ioctl fast path reads it without a lock: a set bit
 * only sends the call down the full path, which reads the filter under RCU;
 * bits a new filter needs are set before it is published, and bits it no
 * longer needs are cleared after.
 */
unsigned long vgpu_hot[VGPU_NODE_KINDS][BITS_TO_LONGS(256)];

/* Caller holds vgpu_filter_mutex (or is module init). */
static void vgpu_hot_set(const struct vgpu_filter *f, bool keep)
{
	DECLARE_BITMAP(base, 256);
	unsigned long v;
	u32 node, w;

	for (node = 0; node < VGPU_NODE_KINDS; node++) {
		bitmap_zero(base, 256);
		if (node != VGPU_NODE_UVM)
			__set_bit(NV_ESC_IOCTL_XFER_CMD, base);
		vgpu_fdx_mark(base, node);
		for (w = 0; w < BITS_TO_LONGS(256); w++) {
			v = base[w];
			if (f)
				v |= f->nr_map[node][w];
			if (keep)
				v |= vgpu_hot[node][w];
			WRITE_ONCE(vgpu_hot[node][w], v);
		}
	}
}

void vgpu_filter_init(void)
{
	vgpu_hot_set(NULL, false);
}

/* Does [off, off + len) fit in a params block of @size (0: any size)? */
static bool vgpu_off_ok(u32 off, u32 len, u32 size)
{
	u32 limit = size ? size : VGPU_PARAMS_MAX;

	return limit >= len && off <= limit - len;
}

static int vgpu_rule_check(const struct vgpu_rule *r, const char **why)
{
	if (!r->node_mask || (r->node_mask & ~VGPU_NODE_MASK_ALL)) {
		*why = "rule node_mask is empty or has unknown bits";
		return -EINVAL;
	}
	if (r->flags & ~(VGPU_RULE_F_POST | VGPU_RULE_F_SHADOW |
			 VGPU_RULE_F_LEN_FIXED)) {
		*why = "unknown rule flags";
		return -EINVAL;
	}
	/* A UVM call's size is the rule's: a shadow needs to know it. */
	if ((r->flags & VGPU_RULE_F_SHADOW) &&
	    (r->node_mask & BIT(VGPU_NODE_UVM)) && !r->size) {
		*why = "VGPU_RULE_F_SHADOW on the UVM node needs the params size";
		return -EINVAL;
	}
	if (r->n_match > VGPU_RULE_MATCH_MAX) {
		*why = "rule n_match over VGPU_RULE_MATCH_MAX";
		return -EINVAL;
	}
	if (r->size > VGPU_PARAMS_MAX) {
		*why = "rule size over VGPU_PARAMS_MAX";
		return -EINVAL;
	}
	if (r->match_off != VGPU_OFF_NONE &&
	    !vgpu_off_ok(r->match_off, sizeof(u32), r->size)) {
		*why = "rule match_off + 4 exceeds the params size";
		return -EINVAL;
	}
	if (r->ptr_off != VGPU_OFF_NONE) {
		if (!vgpu_off_ok(r->ptr_off, sizeof(u64), r->size)) {
			*why = "rule ptr_off + 8 exceeds the params size";
			return -EINVAL;
		}
		if (r->flags & VGPU_RULE_F_LEN_FIXED) {
			if (!r->len_off || r->len_off > VGPU_PARAMS_MAX) {
				*why = "rule fixed length not in 1..VGPU_PARAMS_MAX";
				return -EINVAL;
			}
		} else if (r->len_off == VGPU_OFF_NONE ||
			   !vgpu_off_ok(r->len_off, sizeof(u32), r->size)) {
			*why = "rule len_off missing or + 4 exceeds the params size";
			return -EINVAL;
		}
	} else if (r->flags & VGPU_RULE_F_LEN_FIXED) {
		*why = "VGPU_RULE_F_LEN_FIXED without ptr_off";
		return -EINVAL;
	}
	return 0;
}

/*
 * Checks @n's list against @f's rules and stores it with its rule. The
 * list's pointer and count lie in the rule's buffer, which is at most
 * VGPU_PARAMS_MAX bytes: a call whose buffer is shorter sends no list. The
 * whole list, at most @max_count entries, is one netlink attribute and one
 * block of a shadow: at most VGPU_PARAMS_MAX bytes.
 */
static int vgpu_nested_add(struct vgpu_filter *f,
			   const struct vgpu_rule_nested *n, const char **why)
{
	if (n->rule >= f->n_rules) {
		*why = "nested rule index out of range";
		return -EINVAL;
	}
	if (f->rules[n->rule].ptr_off == VGPU_OFF_NONE) {
		*why = "nested list on a rule without a buffer";
		return -EINVAL;
	}
	if (f->nested[n->rule].elem_size) {
		*why = "two nested lists on one rule";
		return -EINVAL;
	}
	if (n->reserved) {
		*why = "nested reserved must be 0";
		return -EINVAL;
	}
	if (!vgpu_off_ok(n->ptr_off, sizeof(u64), 0) ||
	    !vgpu_off_ok(n->count_off, sizeof(u32), 0)) {
		*why = "nested ptr_off + 8 or count_off + 4 beyond the rule's buffer";
		return -EINVAL;
	}
	if (!n->elem_size || n->elem_size > VGPU_PARAMS_MAX) {
		*why = "nested elem_size must be 1..VGPU_PARAMS_MAX";
		return -EINVAL;
	}
	if (!n->max_count || n->max_count > VGPU_NESTED_MAX) {
		*why = "nested max_count must be 1..VGPU_NESTED_MAX";
		return -EINVAL;
	}
	if (n->elem_size * n->max_count > VGPU_PARAMS_MAX) {
		*why = "nested elem_size * max_count over VGPU_PARAMS_MAX";
		return -EINVAL;
	}
	f->nested[n->rule] = *n;
	return 0;
}

/**
 * vgpu_filter_set - validate and install a new filter, atomically
 * @flags: VGPU_FILTER_*
 * @rules: the rules (may be unaligned netlink payload)
 * @n_rules: how many
 * @nested: the rules' nested lists, struct vgpu_rule_nested (may be
 *	unaligned netlink payload)
 * @n_nested: how many
 * @why: set to a message for the sender on error
 *
 * Return: 0, -EINVAL for an invalid rule or nested list (nothing changes),
 * -ENOMEM.
 */
int vgpu_filter_set(u32 flags, const void *rules, u32 n_rules,
		    const void *nested, u32 n_nested, const char **why)
{
	struct vgpu_filter *f, *old;
	struct vgpu_rule_nested n;
	struct vgpu_rule *r;
	u32 i;
	int err;

	if (n_rules > VGPU_RULES_MAX) {
		*why = "more than VGPU_RULES_MAX rules";
		return -EINVAL;
	}
	f = kzalloc(struct_size(f, rules, n_rules), GFP_KERNEL);
	if (!f)
		return -ENOMEM;
	f->flags = flags;
	f->n_rules = n_rules;
	if (n_rules)
		memcpy(f->rules, rules, n_rules * sizeof(*r));
	for (i = 0; i < n_rules; i++) {
		r = &f->rules[i];
		err = vgpu_rule_check(r, why);
		if (err) {
			kfree(f);
			return err;
		}
		if (r->node_mask & BIT(VGPU_NODE_CTL))
			__set_bit(r->nr & 0xff, f->nr_map[VGPU_NODE_CTL]);
		if (r->node_mask & BIT(VGPU_NODE_GPU))
			__set_bit(r->nr & 0xff, f->nr_map[VGPU_NODE_GPU]);
		if (r->node_mask & BIT(VGPU_NODE_UVM))
			__set_bit(r->nr & 0xff, f->nr_map[VGPU_NODE_UVM]);
	}
	if (n_nested > VGPU_RULES_MAX) {
		*why = "more nested lists than VGPU_RULES_MAX";
		kfree(f);
		return -EINVAL;
	}
	for (i = 0; i < n_nested; i++) {
		memcpy(&n, nested + i * sizeof(n), sizeof(n));
		err = vgpu_nested_add(f, &n, why);
		if (err) {
			kfree(f);
			return err;
		}
	}

	mutex_lock(&vgpu_filter_mutex);
	vgpu_hot_set(f, true);
	old = rcu_replace_pointer(vgpu_filter, f,
				  lockdep_is_held(&vgpu_filter_mutex));
	synchronize_rcu();	/* no reader sees @old: its bits may go */
	vgpu_hot_set(f, false);
	mutex_unlock(&vgpu_filter_mutex);
	if (old)
		kfree_rcu(old, rcu);
	return 0;
}

/* Does the filter have all VGPU_FILTER_* bits of @flag? */
bool vgpu_filter_wants(u32 flag)
{
	struct vgpu_filter *f;
	bool wants;

	rcu_read_lock();
	f = rcu_dereference(vgpu_filter);
	wants = f && (f->flags & flag) == flag;
	rcu_read_unlock();
	return wants;
}

static bool vgpu_rule_selects(const struct vgpu_rule *r, u32 node, u32 nr)
{
	return (r->node_mask & BIT(node)) && r->nr == nr;
}

/**
 * vgpu_filter_candidates - may some rule select this call?
 * @node: enum vgpu_node
 * @nr: escape number (UVM: the command)
 * @size: in: the call's params size; out: how many bytes of params to copy
 *
 * The quick reject of the fast path. On the UVM node the size of a call is
 * not encoded in its command: a rule's size is the call's size, and the
 * copy covers the largest candidate rule.
 */
bool vgpu_filter_candidates(u32 node, u32 nr, u32 *size)
{
	const struct vgpu_rule *r;
	struct vgpu_filter *f;
	bool any = false;
	u32 i, max = 0;

	rcu_read_lock();
	f = rcu_dereference(vgpu_filter);
	if (!f || !test_bit(nr & 0xff, f->nr_map[node]))
		goto out;
	for (i = 0; i < f->n_rules; i++) {
		r = &f->rules[i];
		if (!vgpu_rule_selects(r, node, nr))
			continue;
		if (node == VGPU_NODE_UVM) {
			max = max(max, r->size);
			any = true;
		} else if (!r->size || r->size == *size) {
			any = true;
			break;
		}
	}
	if (node == VGPU_NODE_UVM)
		*size = max;
out:
	rcu_read_unlock();
	return any;
}

/**
 * vgpu_filter_match - the first rule that selects this call
 * @node: enum vgpu_node
 * @nr: escape number
 * @size: the call's params size (UVM: the number of bytes in @params)
 * @params: the kernel copy of the params
 * @out: the matching rule, copied
 * @nested: that rule's nested list, copied (@elem_size 0: none)
 * @eff: the params size of the call under that rule
 */
bool vgpu_filter_match(u32 node, u32 nr, u32 size, const void *params,
		       struct vgpu_rule *out, struct vgpu_rule_nested *nested,
		       u32 *eff)
{
	const struct vgpu_rule *r;
	struct vgpu_filter *f;
	bool found = false;
	u32 i, j, n, key, len;

	rcu_read_lock();
	f = rcu_dereference(vgpu_filter);
	if (!f)
		goto out;
	for (i = 0; i < f->n_rules && !found; i++) {
		r = &f->rules[i];
		if (!vgpu_rule_selects(r, node, nr))
			continue;
		if (node == VGPU_NODE_UVM) {
			if (r->size > size)
				continue;	/* filter changed under us */
			len = r->size;
		} else {
			if (r->size && r->size != size)
				continue;
			len = size;
		}
		if (r->match_off == VGPU_OFF_NONE) {
			found = true;
		} else if (vgpu_off_ok(r->match_off, sizeof(u32), len) && len) {
			key = get_unaligned((const u32 *)(params + r->match_off));
			n = min_t(u32, r->n_match, VGPU_RULE_MATCH_MAX);
			for (j = 0; j < n; j++) {
				if (r->match[j] == key) {
					found = true;
					break;
				}
			}
		}
		if (found) {
			*out = *r;
			*nested = f->nested[i];
			*eff = len;
		}
	}
out:
	rcu_read_unlock();
	return found;
}

/* Module exit: no reader is left. */
void vgpu_filter_exit(void)
{
	struct vgpu_filter *f;

	f = rcu_replace_pointer(vgpu_filter, NULL, true);
	kfree(f);
}
