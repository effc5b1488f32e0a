/* SPDX-License-Identifier: GPL-2.0 WITH Linux-syscall-note */
/*
 * vgpu: the contract between the vgpu kernel module and the vgpud daemon.
 *
 * The module exposes emulated NVIDIA device files under /dev/vgpu/ and
 * forwards their calls to a backing driver. Calls selected by a filter that
 * the daemon installs are first sent to the daemon as an UPCALL over the
 * generic netlink family VGPU_GENL_NAME; the caller sleeps until the daemon
 * answers with a VERDICT, or until the upcall times out.
 *
 * Every structure below has fixed-width fields, explicit padding and a size
 * pinned by tests on both sides (kmod BUILD_BUG_ON, tests/unit). Reserved
 * fields are zero when sent and must be zero when received.
 *
 * Changelog (VGPU_PROTO_VERSION):
 *   1: initial protocol (OPEN/IOCTL upcalls, ALLOW/DENY/FAIL_STATUS,
 *      POST/CLOSE events); REPLY verdicts and POST upcalls.
 *   2: VGPU_RULE_F_SHADOW (the driver reads the checked copy);
 *      VGPU_CMD_LIST_CONTEXTS (live contexts, for a restarted daemon);
 *      VGPU_CMD_SCHEDULE (channel-group scheduling through the owner's file).
 *   3: VGPU_VERDICT_F_SCHED_OFF (a new channel group is turned off before
 *      the call returns); VGPU_SCHED_OWNER_OFF.
 *   4: hostile tenants: VGPU_CMD_OBJECT (the driver's truth about an
 *      object, asked in the daemon's process); FAIL_STATUS answers a POST
 *      upcall; VGPU_EVENT_ABANDONED and VGPU_EVENT_REVOKED; VGPU_CMD_REVOKE;
 *      nested lists in a rule's buffer (VGPU_A_NESTED, VGPU_A_DATA2); the
 *      opener's start time (VGPU_A_OPENER, VGPU_A_OPENERS); VGPU_A_STATS4;
 *      DENY errnos limited to 1..511; every call read for the filter is a
 *      shadow call; an XFER wrapper's cmd is its escape number, whole.
 *   5: ALLOW of an IOCTL upcall may carry VGPU_A_PARAMS: the driver reads
 *      those params instead of the checked ones (the daemon names the new
 *      object's handle, which the driver would otherwise generate and
 *      report only in the tenant-writable results).
 *   6: VGPU_RULE_F_LEN_FIXED: a rule's buffer has a fixed length, carried
 *      in len_off (RM_ALLOC: the driver reads alloc params by the size
 *      their class takes and ignores NVOS21/NVOS64 paramsSize, which
 *      libcuda leaves 0: seen in a trace of driver 580.159.04).
 *   7: SCHEDULE ops VGPU_SCHED_TIMESLICE (NVA06C_CTRL_CMD_SET_TIMESLICE,
 *      struct vgpu_sched's reserved field becomes arg, the timeslice in us)
 *      and VGPU_SCHED_PREEMPT (NVA06C_CTRL_CMD_PREEMPT, bWait 0).
 *   8: SCHEDULE op VGPU_SCHED_INTERLEAVE (NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL,
 *      arg the level).
 *
 * The protocol is append-only: new commands, attributes and enum values are
 * added at the end; existing layouts never change.
 */
#ifndef _UAPI_LINUX_VGPU_H
#define _UAPI_LINUX_VGPU_H

#include <linux/types.h>

#define VGPU_GENL_NAME		"vgpu"
#define VGPU_GENL_VERSION	1
#define VGPU_PROTO_VERSION	8

/* Kinds of emulated node. A rule's node_mask is a set of (1 << node). */
enum vgpu_node {
	VGPU_NODE_CTL = 0,	/* /dev/vgpu/nvidiactl */
	VGPU_NODE_GPU = 1,	/* /dev/vgpu/nvidiaN */
	VGPU_NODE_UVM = 2,	/* /dev/vgpu/nvidia-uvm */
};

/* Offsets that are absent in a rule. */
#define VGPU_OFF_NONE		0xffffffffU
/* Most values one rule matches (control command ids or object classes). */
#define VGPU_RULE_MATCH_MAX	32
/* Most rules in one filter. */
#define VGPU_RULES_MAX		32
/* Largest params block the module copies for an upcall (NVIDIA's cap). */
#define VGPU_PARAMS_MAX		16384

/**
 * struct vgpu_rule - one selector of the slow path
 * @node_mask: nodes it applies to, bits (1 << enum vgpu_node)
 * @nr: escape number after IOCTL_XFER_CMD unwrapping (the wrapper's cmd,
 *	whole, as the driver takes it); on the UVM node the plain command
 *	number
 * @size: exact params size this rule applies to; 0 for any size
 * @match_off: offset in params of a u32 key (object class, control command);
 *	VGPU_OFF_NONE selects every call with this nr and size
 * @ptr_off: offset in params of a u64 user pointer whose buffer is copied
 *	into the upcall (VGPU_A_DATA); VGPU_OFF_NONE for none
 * @len_off: offset in params of the u32 byte length of that buffer; with
 *	VGPU_RULE_F_LEN_FIXED, the length itself (1..VGPU_PARAMS_MAX)
 * @n_match: number of valid entries in @match
 * @flags: VGPU_RULE_F_*
 * @match: keys that select the slow path
 */
struct vgpu_rule {
	__u32 node_mask;
	__u32 nr;
	__u32 size;
	__u32 match_off;
	__u32 ptr_off;
	__u32 len_off;
	__u32 n_match;
	__u32 flags;
	__u32 match[VGPU_RULE_MATCH_MAX];
};

/* struct vgpu_rule flags */
#define VGPU_RULE_F_POST	(1U << 0) /* POST event after an allowed call */
/*
 * The driver reads the module's checked copy: an allowed call is handed to
 * the driver with the params block (and the rule's buffer) exactly as the
 * upcall carried them, from memory the caller did not pass, and the
 * driver's results are copied back to the caller's blocks afterwards. A
 * caller's thread rewriting its params during the call changes nothing.
 * v4: the module gives the driver its checked copy of every call it read
 * to match it against the filter (an allowed call under any rule, a call
 * no rule's key matched, a fail-open forward): the flag is implied, and
 * kept so that a v3 filter still validates.
 */
#define VGPU_RULE_F_SHADOW	(1U << 1)
/*
 * v6: the buffer at ptr_off is len_off bytes long, a length and not an
 * offset: the size the driver reads, whatever the params say. RM_ALLOC
 * reads its alloc params by the size their object class takes and never
 * looks at NVOS21/NVOS64 paramsSize. A NULL pointer copies nothing (the
 * driver sees the NULL too and decides whether the class allows it).
 */
#define VGPU_RULE_F_LEN_FIXED	(1U << 2)

/* VGPU_A_FILTER_FLAGS */
#define VGPU_FILTER_OPEN	(1U << 0)	/* upcall every open for a verdict */
#define VGPU_FILTER_UVM_MMAP	(1U << 1)	/* upcall every mmap of nvidia-uvm */

/* enum vgpu_upcall_kind - what an upcall asks the daemon */
enum vgpu_upcall_kind {
	VGPU_UPCALL_OPEN = 1,	/* may this opener open the node? */
	VGPU_UPCALL_IOCTL = 2,	/* may this call go to the driver? */
	VGPU_UPCALL_POST = 3,	/* the driver returned: keep or replace results? */
	VGPU_UPCALL_MMAP = 4,	/* may this mapping be made? */
};

/**
 * struct vgpu_mmap_params - params block of an MMAP upcall (VGPU_A_PARAMS)
 * @pgoff: the mapping's offset in pages
 * @length: its length in bytes
 * @prot: PROT_* bits asked for
 * @flags: MAP_SHARED (1) or MAP_PRIVATE (2)
 */
struct vgpu_mmap_params {
	__u64 pgoff;
	__u64 length;
	__u32 prot;
	__u32 flags;
};

/* struct vgpu_upcall flags */
#define VGPU_UPCALL_F_XFER	(1U << 0) /* came wrapped in IOCTL_XFER_CMD */
#define VGPU_UPCALL_F_DATA_FAULT (1U << 1) /* rule's pointer could not be read */
#define VGPU_UPCALL_F_DATA_BIG	(1U << 2) /* rule's length over VGPU_PARAMS_MAX */
#define VGPU_UPCALL_F_DATA2_FAULT (1U << 3) /* nested list could not be read */
#define VGPU_UPCALL_F_DATA2_BIG	(1U << 4) /* nested list's count over its max */

/* Largest errno a DENY may carry: the kernel's own 512.. are internal. */
#define VGPU_ERRNO_MAX		511

/**
 * struct vgpu_upcall - header of an upcall (VGPU_A_UPCALL)
 * @id: unique id, echoed in the verdict
 * @ctx_id: the emulated file (one per open), unique while the module lives
 * @cgroup_id: cgroup v2 id of the opener, at open
 * @kind: enum vgpu_upcall_kind
 * @node: enum vgpu_node
 * @minor: GPU index for VGPU_NODE_GPU, else 0
 * @cmd: the ioctl command word as issued (0 for OPEN)
 * @nr: escape number after unwrapping (UVM: the command)
 * @flags: VGPU_UPCALL_F_*
 * @pid: opener's thread id, at open (init pid namespace)
 * @tgid: opener's process id, at open
 * @uid: opener's fsuid, at open (init user namespace)
 * @gid: opener's fsgid, at open
 * @caller_pid: calling thread (init pid namespace)
 * @caller_tgid: calling process
 * @ret: POST: the driver's return value; else 0
 * @reserved: zero
 *
 * An IOCTL upcall carries the params block (VGPU_A_PARAMS) and, when the
 * matching rule names a pointer, the buffer it points to (VGPU_A_DATA). A
 * POST upcall (asked for by VGPU_VERDICT_F_POST) carries the same blocks as
 * the driver left them, and the same id as the IOCTL upcall it follows. An
 * OPEN upcall carries the opener's cgroup v2 path (VGPU_A_CGROUP). An MMAP
 * upcall (VGPU_FILTER_UVM_MMAP) carries struct vgpu_mmap_params; its verdict
 * is ALLOW or DENY.
 */
struct vgpu_upcall {
	__u64 id;
	__u64 ctx_id;
	__u64 cgroup_id;
	__u32 kind;
	__u32 node;
	__u32 minor;
	__u32 cmd;
	__u32 nr;
	__u32 flags;
	__u32 pid;
	__u32 tgid;
	__u32 uid;
	__u32 gid;
	__u32 caller_pid;
	__u32 caller_tgid;
	__s32 ret;
	__u32 reserved;
};

/* enum vgpu_verdict_action - the daemon's answer */
enum vgpu_verdict_action {
	VGPU_VERDICT_ALLOW = 1,		/* forward to the driver */
	VGPU_VERDICT_DENY = 2,		/* fail the call with -error */
	VGPU_VERDICT_FAIL_STATUS = 3,	/* write status at status_off, return 0 */
	VGPU_VERDICT_REPLY = 4,		/* write the verdict's blocks, return 0 */
};

/* struct vgpu_verdict flags */
#define VGPU_VERDICT_F_POST	(1U << 0) /* ALLOW: upcall again after the call */
/*
 * ALLOW of an RM_ALLOC (NVOS21 or NVOS64 params): when the driver has made a
 * channel group (KEPLER_CHANNEL_GROUP_A), the module turns its scheduling
 * off (GPFIFO_SCHEDULE through the caller's file, in the caller's process)
 * before the call returns, and remembers it as off like a SCHEDULE entry.
 */
#define VGPU_VERDICT_F_SCHED_OFF (1U << 1)

/**
 * struct vgpu_verdict - the daemon's answer to one upcall (VGPU_A_VERDICT)
 * @id: the upcall's id
 * @action: enum vgpu_verdict_action
 * @error: DENY: a positive errno (1..VGPU_ERRNO_MAX); else 0
 * @status: FAIL_STATUS: the NVIDIA status written into the caller's params
 * @status_off: FAIL_STATUS: its offset; status_off + 4 <= params size
 * @flags: VGPU_VERDICT_F_*
 * @reserved: zero
 *
 * REPLY answers an IOCTL upcall without calling the driver, or replaces the
 * results of a POST upcall: the verdict message carries VGPU_A_PARAMS and/or
 * VGPU_A_DATA, each exactly as long as the block of that name in the upcall,
 * which the module writes over the caller's params / the rule's buffer; the
 * call returns 0. ALLOW with VGPU_VERDICT_F_POST forwards the call and then
 * sends a POST upcall (instead of a POST event), whose verdict is ALLOW
 * (keep the driver's results), REPLY, or FAIL_STATUS (v4: the status is
 * written over the caller's params and the call returns 0; the daemon has
 * undone the call, e.g. freed an allocation found over quota). A POST
 * upcall that gets no verdict keeps the driver's results: the call has
 * happened and cannot be undone.
 *
 * v5: ALLOW of an IOCTL upcall may carry VGPU_A_PARAMS, exactly as long as
 * the upcall's: the driver is called on those params instead of the ones
 * the upcall carried (the rule's pointer field excepted: it stays the
 * module's), and the POST event or upcall carries what the driver made of
 * them. The daemon uses it to choose the handle of an object the driver
 * would otherwise generate.
 *
 * A verdict that does not fit its upcall is refused (-EINVAL) and changes
 * nothing; a verdict for an upcall that has completed is refused (-ENOENT).
 */
struct vgpu_verdict {
	__u64 id;
	__u32 action;
	__u32 error;
	__u32 status;
	__u32 status_off;
	__u32 flags;
	__u32 reserved;
};

/* enum vgpu_event_kind - notifications that need no answer */
enum vgpu_event_kind {
	VGPU_EVENT_POST = 1,	/* an allowed call returned (VGPU_RULE_F_POST) */
	VGPU_EVENT_CLOSE = 2,	/* the last reference to a context is gone */
	VGPU_EVENT_ABANDONED = 3, /* the module gave up on an upcall (v4) */
	VGPU_EVENT_REVOKED = 4,	/* a context was revoked (v4) */
};

/*
 * enum vgpu_revoke_reason - VGPU_EVENT_REVOKED's @nr
 *
 * A revoked context fails every later call (-EIO) and its backing file is
 * released once the calls in flight have returned, which frees whatever the
 * driver held for it.
 */
enum vgpu_revoke_reason {
	VGPU_REVOKE_DAEMON = 1,		/* VGPU_CMD_REVOKE */
	VGPU_REVOKE_SHADOW = 2,		/* a shadow was unmapped or replaced */
	VGPU_REVOKE_RECHECK = 3,	/* params changed under a forwarded call */
};

/**
 * struct vgpu_event - header of an event (VGPU_A_EVENT)
 * @ctx_id: the context
 * @upcall_id: POST, ABANDONED: the upcall it follows; else 0
 * @kind: enum vgpu_event_kind
 * @nr: POST: the escape number; ABANDONED: the upcall's enum
 *	vgpu_upcall_kind; REVOKED: enum vgpu_revoke_reason
 * @ret: POST: the driver's return value; ABANDONED: the negative errno of
 *	why (-ETIMEDOUT, -EINTR, -EHOSTDOWN, -ENOBUFS); else 0
 * @reserved: zero
 *
 * A POST event carries the params after the call (VGPU_A_PARAMS) and the
 * rule's buffer after the call (VGPU_A_DATA) when it could be read. An
 * ABANDONED event says that no verdict will be taken for that upcall (a
 * late one gets -ENOENT): whatever the daemon reserved for it is free, and
 * an abandoned OPEN upcall's context never existed.
 */
struct vgpu_event {
	__u64 ctx_id;
	__u64 upcall_id;
	__u32 kind;
	__u32 nr;
	__s32 ret;
	__u32 reserved;
};

/**
 * struct vgpu_stats - module counters (VGPU_A_STATS), monotonic
 * @version: VGPU_PROTO_VERSION of the module
 * @daemon_portid: netlink port of the registered daemon, 0 when none
 * @contexts: emulated files open now
 * @opens: successful opens
 * @ioctls: ioctl calls
 * @upcalls: upcalls sent
 * @verdicts: verdicts applied
 * @timeouts: upcalls that got no verdict in time
 * @lost: upcalls that could not be sent, and late or unknown verdicts
 * @fail_open: calls forwarded by the fail-open policy
 * @fail_closed: calls refused by the fail-closed policy
 * @killed: callers killed while waiting
 * @events: events sent
 * @events_lost: events that could not be sent
 * @bad_verdicts: verdicts refused as malformed
 * @mmaps: mmap calls forwarded
 */
struct vgpu_stats {
	__u32 version;
	__u32 daemon_portid;
	__u64 contexts;
	__u64 opens;
	__u64 ioctls;
	__u64 upcalls;
	__u64 verdicts;
	__u64 timeouts;
	__u64 lost;
	__u64 fail_open;
	__u64 fail_closed;
	__u64 killed;
	__u64 events;
	__u64 events_lost;
	__u64 bad_verdicts;
	__u64 mmaps;
};

/**
 * struct vgpu_context - one live context (VGPU_A_CONTEXTS entry)
 * @ctx_id: the context
 * @cgroup_id: cgroup v2 id of the opener
 * @node: enum vgpu_node
 * @minor: GPU index for VGPU_NODE_GPU, else 0
 * @pid: opener's thread id
 * @tgid: opener's process id
 * @uid: opener's fsuid
 * @gid: opener's fsgid
 */
struct vgpu_context {
	__u64 ctx_id;
	__u64 cgroup_id;
	__u32 node;
	__u32 minor;
	__u32 pid;
	__u32 tgid;
	__u32 uid;
	__u32 gid;
};

/* Most entries in one LIST_CONTEXTS reply or one SCHEDULE request. */
#define VGPU_LIST_MAX		1024
#define VGPU_SCHED_MAX		256

/*
 * enum vgpu_sched_state - what a SCHEDULE entry makes of its group
 *
 * The module remembers the groups it turned off with VGPU_SCHED_OFF (and
 * VGPU_VERDICT_F_SCHED_OFF), and turns them on again in the next daemon to
 * register, so that a daemon that dies leaves no tenant stalled. A group
 * turned off with VGPU_SCHED_OWNER_OFF, for its owner, is not remembered.
 *
 * v7: VGPU_SCHED_TIMESLICE sets the group's timeslice to arg microseconds
 * (NVA06C_CTRL_CMD_SET_TIMESLICE; the driver judges the value: an out of
 * range one gets its status) and VGPU_SCHED_PREEMPT preempts the group off
 * its engine (NVA06C_CTRL_CMD_PREEMPT, bWait and bManualTimeout 0). Each
 * is one control through the owner's file, like ON and OFF, and neither is
 * remembered.
 *
 * v8: VGPU_SCHED_INTERLEAVE sets the group's runlist interleave level to
 * arg (NVA06C_CTRL_CMD_SET_INTERLEAVE_LEVEL: 0 LOW, 1 MEDIUM, 2 HIGH; the
 * driver judges the value, and checks CAP_SYS_NICE of the daemon, in
 * whose process the control runs). Not remembered either.
 */
enum vgpu_sched_state {
	VGPU_SCHED_OFF = 0,
	VGPU_SCHED_ON = 1,
	VGPU_SCHED_OWNER_OFF = 2,
	VGPU_SCHED_TIMESLICE = 3,
	VGPU_SCHED_PREEMPT = 4,
	VGPU_SCHED_INTERLEAVE = 5,
};

/**
 * struct vgpu_sched - one scheduling control of one channel group
 * @ctx_id: the context (a nvidiactl file) whose client owns the group
 * @h_client: the RM client
 * @h_object: the channel group (KEPLER_CHANNEL_GROUP_A)
 * @enable: enum vgpu_sched_state, the op
 * @arg: VGPU_SCHED_TIMESLICE: the timeslice in us; VGPU_SCHED_INTERLEAVE:
 *	the level; zero for the others (before v7: reserved, zero)
 *
 * An entry with an unknown op, or a nonzero arg where none is taken,
 * refuses its whole message with -EINVAL: nothing of it is issued.
 */
struct vgpu_sched {
	__u64 ctx_id;
	__u32 h_client;
	__u32 h_object;
	__u32 enable;
	__u32 arg;
};

/**
 * struct vgpu_sched_result - outcome of one struct vgpu_sched, same order
 * @error: 0, or a negative errno (no such context: -ENOENT; the ioctl's)
 * @status: the NVIDIA status the driver returned (NV_OK = 0)
 */
struct vgpu_sched_result {
	__s32 error;
	__u32 status;
};

/**
 * struct vgpu_opener - more of the opener (VGPU_A_OPENER, VGPU_A_OPENERS)
 * @start_boottime_ns: the opening process's start time (boot clock), so
 *	that a pid binding does not pass to a later process with the same pid
 * @reserved: zero
 *
 * An OPEN upcall carries it; a LIST_CONTEXTS reply carries VGPU_A_OPENERS,
 * one per entry of VGPU_A_CONTEXTS, in the same order.
 */
struct vgpu_opener {
	__u64 start_boottime_ns;
	__u64 reserved;
};

/* Most entries of one nested list (VGPU_A_DATA2). */
#define VGPU_NESTED_MAX		256

/**
 * struct vgpu_rule_nested - a list behind a pointer in a rule's buffer
 * @rule: index of the rule in VGPU_A_RULES; that rule names a buffer
 * @ptr_off: offset in the rule's buffer of the list's u64 user pointer
 * @count_off: offset in the rule's buffer of the u32 entry count
 * @elem_size: size of one entry, 1..VGPU_PARAMS_MAX
 * @max_count: most entries copied, 1..VGPU_NESTED_MAX; a larger count
 *	sets VGPU_UPCALL_F_DATA2_BIG and copies nothing
 * @reserved: zero
 *
 * The module copies the list in the caller's context and sends it as
 * VGPU_A_DATA2; the driver is handed the module's copy (a shadow call); a
 * REPLY may carry VGPU_A_DATA2 of the same length to rewrite it. A rule has
 * at most one nested list.
 */
struct vgpu_rule_nested {
	__u32 rule;
	__u32 ptr_off;
	__u32 count_off;
	__u32 elem_size;
	__u32 max_count;
	__u32 reserved;
};

/*
 * enum vgpu_obj_op_kind - what VGPU_CMD_OBJECT asks the driver
 *
 * Each operation is one RM call issued on the backing file of the context
 * whose client owns the object, in the daemon's process, from a small
 * private mapping of the daemon's memory: nothing of it is in the tenant's
 * reach. @value of the result:
 */
enum vgpu_obj_op_kind {
	VGPU_OBJ_CLASS = 1,	/* the object's class (CLIENT_GET_HANDLE_INFO) */
	VGPU_OBJ_PARENT = 2,	/* its parent's handle (CLIENT_GET_HANDLE_INFO) */
	VGPU_OBJ_MEM_SIZE = 3,	/* a memory object's size in bytes (GET_SURFACE_INFO) */
	VGPU_OBJ_FREE = 4,	/* RM_FREE of the object and its subtree; 0 */
};

/* Most operations in one OBJECT request. */
#define VGPU_OBJ_MAX		64

/**
 * struct vgpu_obj_op - one question to the driver about one object
 * @ctx_id: the context (a nvidiactl file) whose client owns the object
 * @h_client: the RM client
 * @h_parent: the object's parent (VGPU_OBJ_FREE; else 0)
 * @h_object: the object (the client itself to free the client)
 * @op: enum vgpu_obj_op_kind
 */
struct vgpu_obj_op {
	__u64 ctx_id;
	__u32 h_client;
	__u32 h_parent;
	__u32 h_object;
	__u32 op;
};

/**
 * struct vgpu_obj_result - outcome of one struct vgpu_obj_op, same order
 * @error: 0, or a negative errno (no such context: -ENOENT; not a nvidiactl
 *	context: -EINVAL; the ioctl's own)
 * @status: the NVIDIA status of the RM call (NV_OK = 0)
 * @value: see enum vgpu_obj_op_kind; 0 when @error or @status is set
 */
struct vgpu_obj_result {
	__s32 error;
	__u32 status;
	__u64 value;
};

/**
 * struct vgpu_stats4 - counters added in v4 (VGPU_A_STATS4), monotonic
 * @abandoned: upcalls given up (each also an ABANDONED event)
 * @revoked: contexts revoked
 * @tampered: calls whose shadow or params changed under them
 * @throttled: callers that waited for an upcall slot of their context
 * @proxies: fd proxies handed to the driver
 * @objects: VGPU_CMD_OBJECT operations run
 * @reserved: zero
 */
struct vgpu_stats4 {
	__u64 abandoned;
	__u64 revoked;
	__u64 tampered;
	__u64 throttled;
	__u64 proxies;
	__u64 objects;
	__u64 reserved[2];
};

/*
 * enum vgpu_cmd - generic netlink commands of the family
 *
 * Every daemon -> kernel command needs CAP_NET_ADMIN in the initial user
 * namespace, and is taken in the initial network namespace only. Beyond
 * that, only the registered daemon changes what the module enforces
 * (SET_FILTER, VERDICT, UNREGISTER, SCHEDULE, OBJECT, REVOKE), only a sender
 * in the initial pid namespace may register, and the counters and contexts
 * (GET_STATS, LIST_CONTEXTS) are read by the daemon or by a sender in the
 * initial pid namespace. Anyone else gets EPERM.
 */
enum vgpu_cmd {
	VGPU_CMD_UNSPEC,
	/*
	 * daemon -> kernel: VERSION; becomes the responder (EBUSY if taken).
	 * The sender must be in the initial pid namespace.
	 */
	VGPU_CMD_REGISTER,
	/*
	 * daemon -> kernel (registered daemon only): FILTER_FLAGS, RULES,
	 * NESTED (replaces the whole filter)
	 */
	VGPU_CMD_SET_FILTER,
	/*
	 * daemon -> kernel (the registered daemon, or a sender in the initial
	 * pid namespace); reply carries STATS and STATS4
	 */
	VGPU_CMD_GET_STATS,
	/* kernel -> daemon: UPCALL, PARAMS, DATA, DATA2, CGROUP, OPENER */
	VGPU_CMD_UPCALL,
	/*
	 * daemon -> kernel (registered daemon only): VERDICT (+ PARAMS, DATA,
	 * DATA2: REPLY; + PARAMS: ALLOW, v5)
	 */
	VGPU_CMD_VERDICT,
	/* kernel -> daemon: EVENT, PARAMS, DATA */
	VGPU_CMD_EVENT,
	/* daemon -> kernel (registered daemon only): stops being the responder */
	VGPU_CMD_UNREGISTER,
	/*
	 * daemon -> kernel (the registered daemon, or a sender in the initial
	 * pid namespace): CURSOR (first ctx_id wanted); the reply carries
	 * CONTEXTS (ascending ctx_id, at most VGPU_LIST_MAX), OPENERS (v4,
	 * same order) and CURSOR (next ctx_id to ask for, 0 when the list is
	 * complete)
	 */
	VGPU_CMD_LIST_CONTEXTS,
	/*
	 * daemon -> kernel (registered daemon only): SCHED, applied in order
	 * through each owner's backing file; the reply carries SCHED_RESULT.
	 * Groups turned off are turned back on when a new daemon registers.
	 */
	VGPU_CMD_SCHEDULE,
	/*
	 * daemon -> kernel (registered daemon only, v4): OBJ, applied in
	 * order; the reply carries OBJ_RESULT.
	 */
	VGPU_CMD_OBJECT,
	/* daemon -> kernel (registered daemon only, v4): CTX_ID is revoked */
	VGPU_CMD_REVOKE,

	__VGPU_CMD_MAX,
};

#define VGPU_CMD_MAX (__VGPU_CMD_MAX - 1)

/* enum vgpu_attr - attributes; binary ones hold the structs above */
enum vgpu_attr {
	VGPU_A_UNSPEC,
	VGPU_A_VERSION,		/* u32 */
	VGPU_A_FILTER_FLAGS,	/* u32, VGPU_FILTER_* */
	VGPU_A_RULES,		/* array of struct vgpu_rule */
	VGPU_A_STATS,		/* struct vgpu_stats */
	VGPU_A_UPCALL,		/* struct vgpu_upcall */
	VGPU_A_PARAMS,		/* binary, the ioctl params block */
	VGPU_A_DATA,		/* binary, the buffer a rule points to */
	VGPU_A_CGROUP,		/* string, cgroup v2 path of the opener */
	VGPU_A_VERDICT,		/* struct vgpu_verdict (+ PARAMS, DATA: REPLY) */
	VGPU_A_EVENT,		/* struct vgpu_event */
	VGPU_A_CURSOR,		/* u64 */
	VGPU_A_CONTEXTS,	/* array of struct vgpu_context */
	VGPU_A_SCHED,		/* array of struct vgpu_sched */
	VGPU_A_SCHED_RESULT,	/* array of struct vgpu_sched_result */
	VGPU_A_OBJ,		/* array of struct vgpu_obj_op (v4) */
	VGPU_A_OBJ_RESULT,	/* array of struct vgpu_obj_result (v4) */
	VGPU_A_CTX_ID,		/* u64 (v4) */
	VGPU_A_NESTED,		/* array of struct vgpu_rule_nested (v4) */
	VGPU_A_DATA2,		/* binary, a rule's nested list (v4) */
	VGPU_A_OPENER,		/* struct vgpu_opener (v4) */
	VGPU_A_OPENERS,		/* array of struct vgpu_opener (v4) */
	VGPU_A_STATS4,		/* struct vgpu_stats4 (v4) */

	__VGPU_A_MAX,
};

#define VGPU_A_MAX (__VGPU_A_MAX - 1)

#endif /* _UAPI_LINUX_VGPU_H */
