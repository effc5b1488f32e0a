// SPDX-License-Identifier: GPL-2.0
/*
 * Per-context latency of the calls through /dev/vgpu, for bcc (loaded by
 * vgpud/probes/bcc_probes.py, which attaches the kprobes it finds).
 *
 * A call is followed on the thread that makes it: vgpu_ioctl_enter starts a
 * record, the upcalls it sends and the backing driver's ioctls it makes add
 * their time to it, and vgpu_ioctl_exit, which knows what selected the call
 * (its key), adds one count to each of the call's histograms. Nothing goes
 * to user space per event: the daemon reads the histograms at an interval.
 *
 * The driver's time is counted only inside a vgpu ioctl of the same thread,
 * so the daemon's own calls (SCHEDULE, object queries) and direct users of
 * the backing node are not. A verdict arrives on the daemon's thread: the
 * upcall's id leads back to the caller's record. An upcall outside an ioctl
 * (OPEN, MMAP) is counted at its verdict, under VGPU_LAT_CALL_UPCALL.
 *
 * Slot wait: a channel group the module turned off (vgpu_schedule) waits
 * while it has pending work; an episode ends when the group is turned on
 * or its work is gone, and its length is counted under the group's
 * context. Pending work is invisible to the kernel on a real GPU (work is
 * submitted by doorbell writes): it comes from the driver where the driver
 * says it, nvsim's tracepoint nvsim_group_work (compiled in with
 * -DVGPU_LAT_NVSIM when that tracepoint exists).
 */
#include <uapi/linux/ptrace.h>
#include "vgpu_latency.h"

struct call_rec {
	u64 start;		/* vgpu_ioctl_enter */
	u64 upcall_start;	/* of the upcall in flight, else 0 */
	u64 upcall_ns;		/* summed over the call's upcalls */
	u64 driver_start;	/* of the driver call in flight, else 0 */
	u64 driver_ns;		/* summed over the call's driver calls */
	u64 upcalls;		/* upcalls the call sent */
	u64 drivers;		/* driver calls the call made */
	u64 uvm;		/* VGPU_LAT_UVM for a call on nvidia-uvm */
};

struct upcall_rec {
	u64 tid;		/* bpf_get_current_pid_tgid() of the caller */
	u64 start;
	u64 ctx_id;
	u64 kind;
};

/* Calls in flight, by thread. */
BPF_HASH(calls, u64, struct call_rec, 16384);
/* Upcalls in flight, by upcall id. */
BPF_HASH(upcalls, u64, struct upcall_rec, 16384);
/* SCHEDULE messages being applied, by the daemon's thread. */
BPF_HASH(schedules, u64, u64, 64);
/*
 * The histograms, by vgpu_lat_key. Not preallocated: an entry is made at a
 * histogram's first count (a value is 528 bytes).
 */
BPF_F_TABLE("hash", struct vgpu_lat_key, struct vgpu_lat_val, hist, HIST_ENTRIES,
	    BPF_F_NO_PREALLOC);
/* A zeroed value to make entries from (over the 512 bytes of BPF stack). */
BPF_PERCPU_ARRAY(empty, struct vgpu_lat_val, 1);
BPF_ARRAY(stats, u64, VGPU_LAT_STAT_N);

static void count(u64 ctx_id, u64 which, u64 call, u64 ns)
{
	struct vgpu_lat_key key = {
		.ctx_id = ctx_id,
		.hist = which,
		.call = call,
	};
	struct vgpu_lat_val *v = hist.lookup(&key);
	u64 *n, slot = bpf_log2l(ns);
	int zero = 0, stat = VGPU_LAT_STAT_DROPPED;

	if (!v) {
		v = empty.lookup(&zero);
		if (v)
			hist.insert(&key, v);	/* a racing insert may win */
		v = hist.lookup(&key);
	}
	if (!v) {
		n = stats.lookup(&stat);
		if (n)
			__sync_fetch_and_add(n, 1);
		return;
	}
	if (slot >= VGPU_LAT_SLOTS)
		slot = VGPU_LAT_SLOTS - 1;
	__sync_fetch_and_add(&v->slots[slot], 1);
	__sync_fetch_and_add(&v->sum_ns, ns);
}

TRACEPOINT_PROBE(vgpu, vgpu_ioctl_enter)
{
	u64 tid = bpf_get_current_pid_tgid();
	struct call_rec rec = { .start = bpf_ktime_get_ns() };

	/* nvidia-uvm's commands are plain numbers: the command is the nr. */
	if (args->cmd == args->nr)
		rec.uvm = VGPU_LAT_UVM;

	calls.update(&tid, &rec);
	return 0;
}

TRACEPOINT_PROBE(vgpu, vgpu_ioctl_exit)
{
	u64 tid = bpf_get_current_pid_tgid();
	struct call_rec *rec = calls.lookup(&tid);
	u64 call, now = bpf_ktime_get_ns();
	u32 nr;

	if (!rec)
		return 0;	/* entered before the probes were attached */
	nr = args->nr;
	if (nr > 0xff && !(rec->uvm && nr == VGPU_LAT_UVM_INITIALIZE))
		nr = VGPU_LAT_NR_OTHER;
	call = VGPU_LAT_CALL(nr | rec->uvm, args->key);
	count(args->ctx_id, VGPU_LAT_TOTAL, call, now - rec->start);
	if (rec->upcalls)
		count(args->ctx_id, VGPU_LAT_UPCALL, call, rec->upcall_ns);
	if (rec->drivers)
		count(args->ctx_id, VGPU_LAT_DRIVER, call, rec->driver_ns);
	calls.delete(&tid);
	return 0;
}

TRACEPOINT_PROBE(vgpu, vgpu_upcall_send)
{
	u64 tid = bpf_get_current_pid_tgid();
	struct call_rec *rec = calls.lookup(&tid);
	struct upcall_rec up = {
		.tid = tid,
		.start = bpf_ktime_get_ns(),
		.ctx_id = args->ctx_id,
		.kind = args->kind,
	};
	u64 id = args->id;

	if (rec) {
		rec->upcall_start = up.start;
		rec->upcalls++;
	}
	upcalls.update(&id, &up);
	return 0;
}

TRACEPOINT_PROBE(vgpu, vgpu_upcall_verdict)
{
	u64 id = args->id, now = bpf_ktime_get_ns();
	struct upcall_rec *up = upcalls.lookup(&id);
	struct call_rec *rec;

	if (!up)
		return 0;
	rec = calls.lookup(&up->tid);
	if (rec && rec->upcall_start) {
		rec->upcall_ns += now - up->start;
		rec->upcall_start = 0;
	} else if (!rec) {
		count(up->ctx_id, VGPU_LAT_UPCALL,
		      VGPU_LAT_CALL_UPCALL(up->kind), now - up->start);
	}
	upcalls.delete(&id);
	return 0;
}

/* The backing driver's ioctl handler, entry and return (kprobes). */
int driver_enter(struct pt_regs *ctx)
{
	u64 tid = bpf_get_current_pid_tgid();
	struct call_rec *rec = calls.lookup(&tid);

	if (rec)
		rec->driver_start = bpf_ktime_get_ns();
	return 0;
}

int driver_return(struct pt_regs *ctx)
{
	u64 tid = bpf_get_current_pid_tgid();
	struct call_rec *rec = calls.lookup(&tid);

	if (rec && rec->driver_start) {
		rec->driver_ns += bpf_ktime_get_ns() - rec->driver_start;
		rec->driver_start = 0;
		rec->drivers++;
	}
	return 0;
}

/* The SCHEDULE command's handler (kprobe): the daemon's decision arrives. */
int schedule_enter(struct pt_regs *ctx)
{
	u64 tid = bpf_get_current_pid_tgid(), now = bpf_ktime_get_ns();

	schedules.update(&tid, &now);
	return 0;
}

int schedule_return(struct pt_regs *ctx)
{
	u64 tid = bpf_get_current_pid_tgid();

	schedules.delete(&tid);
	return 0;
}

/* A channel group's state, for its slot wait. */
struct group_rec {
	u64 ctx_id;	/* of the group's owner, from vgpu_schedule */
	u64 off;	/* turned off by the module */
	u64 pending;	/* has work (the driver says) */
	u64 mark;	/* time accounted up to */
	u64 wait;	/* of the episode in progress */
};

/* By (client << 32 | group) handle: LRU, freed groups are never told. */
BPF_TABLE("lru_hash", u64, struct group_rec, groups, 16384);

/* Accounts the time since the last change; ends an episode that stops. */
static void group_change(struct group_rec *g, u64 off, u64 pending)
{
	u64 now = bpf_ktime_get_ns();

	if (g->off && g->pending)
		g->wait += now - g->mark;
	g->mark = now;
	g->off = off;
	g->pending = pending;
	if (!(off && pending) && g->wait) {
		count(g->ctx_id, VGPU_LAT_SLOT, 0, g->wait);
		g->wait = 0;
	}
}

TRACEPOINT_PROBE(vgpu, vgpu_schedule)
{
	u64 tid = bpf_get_current_pid_tgid();
	u64 *start = schedules.lookup(&tid);
	u64 handle = (u64)args->h_client << 32 | args->h_object;
	struct group_rec zero = {}, *g;

	if (start && !args->enable)
		count(args->ctx_id, VGPU_LAT_SWITCH, 0,
		      bpf_ktime_get_ns() - *start);
	if (args->error || args->status)
		return 0;	/* not applied */
	g = groups.lookup_or_try_init(&handle, &zero);
	if (g) {
		g->ctx_id = args->ctx_id;
		group_change(g, !args->enable, g->pending);
	}
	return 0;
}

#ifdef VGPU_LAT_NVSIM
TRACEPOINT_PROBE(nvsim, nvsim_group_work)
{
	u64 handle = (u64)args->h_client << 32 | args->h_group;
	struct group_rec zero = {}, *g;

	g = groups.lookup_or_try_init(&handle, &zero);
	if (g)
		group_change(g, g->off, args->pending_ns != 0);
	return 0;
}
#endif
