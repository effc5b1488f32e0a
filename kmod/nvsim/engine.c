// SPDX-License-Identifier: GPL-2.0-only
/*
 * nvsim work engine: channel groups execute simulated work.
 *
 * Each GPU has one engine, a kthread that runs one channel group at a time.
 * A group is runnable while it is enabled (GPFIFO_SCHEDULE) and has pending
 * work (NVSIM_ESC_SUBMIT_WORK).  The engine walks its list of groups as
 * the hardware walks its runlist: the list keeps the order in which the
 * groups were made, and a cursor per interleave level marks the last group
 * of that level that got a turn.  The engine takes the next runnable group
 * after the cursor (round robin) and "runs" it by sleeping on an absolute
 * hrtimer until its time slice ends or its pending work would be done.
 * A group that had no work keeps its place: when it is given work it waits
 * for the cursor to come round to it, as on the hardware, and does not go
 * first because it was idle while the others ran.
 *
 * Interleave levels (SET_INTERLEAVE_LEVEL) order the picks as the
 * hardware's runlist does (ctrla06c.h): after every slice of a MEDIUM or
 * LOW group comes a block in which each runnable HIGH group gets one slice,
 * and a LOW group gets a slice after the MEDIUM groups got as many slices
 * as there are MEDIUM groups.  The hardware counts runlist entries, idle
 * ones included; nvsim counts slices run, which differs only while some
 * MEDIUM groups have no work.  With HIGH groups alone, or lower ones
 * alone, the picks are the plain round robin above.
 *
 * Disabling or freeing the running group preempts it at once: the caller
 * ends its slice, starts the next runnable group and wakes the kthread to
 * sleep to that group's deadline.  Work submitted to an idle engine starts
 * the same way, at the submission.
 *
 * PREEMPT (NVA06C_CTRL_CMD_PREEMPT) of the running group ends its slice at
 * once (its turn is taken) and the engine spends ctxsw_us
 * (module parameter) switching, running nothing, before it starts the next
 * runnable group.  PREEMPT of a group that is not running changes nothing.
 * Slices that end on time or run out of work switch at no cost, as before.
 *
 * Accounting is measured ktime: every change of state first charges the
 * time since the engine's last mark, to the engine's context switch in
 * progress (switch_ns), else to the running group (busy, taken from its
 * pending work) or to idle; and to every other group with pending work:
 * turned off (wait: the time a scheduler kept it from running), or on and
 * not running (ready: the time the engine's round robin kept it waiting).
 * A group given work when it had none notes the time; its first engine
 * time after that adds the submit-to-run latency to wake_sum_ns, wake_n
 * and wake_max_ns.  Each engine also counts its kthread's timer wake-ups
 * and how late each ran after its deadline (timer_wakes, late_sum_ns,
 * late_max_ns, late_1ms): the host's timer and scheduling latency, which
 * delays whoever waits for a slice to end (the wake latencies' tail in a
 * TCG guest).  Readers charge too, so counters are exact at the
 * moment they are read, and per engine busy + idle + switch is the time
 * since load.  A slice that overruns its end (timer latency, a stalled
 * CPU) is charged in full and the overrun is owed: it shortens the group's
 * next slices, a whole turn being skipped for each slice owed (up to
 * NVSIM_MAX_DEBT_SLICES), so shares follow the time slices on average.
 *
 * Lifetimes: a group lives in its TSG object (nvsim_obj.tsg).  The object
 * is freed under nvsim_lock after nvsim_group_remove() has taken the group
 * off its engine under the engine's lock (and out of eng->running and
 * eng->last; a cursor on it steps back to the group before it).  The
 * kthread keeps no group across a sleep: each time it wakes it charges and
 * picks again from eng->running and the list, under the lock, so a freed
 * group is never seen again.  Every group is gone
 * before module exit (each belongs to a client of an open file); the
 * kthreads stop there.
 */
#include <linux/hrtimer.h>
#include <linux/kthread.h>
#include <linux/ktime.h>
#include <linux/list.h>
#include <linux/minmax.h>
#include <linux/moduleparam.h>
#include <linux/proc_fs.h>
#include <linux/sched.h>
#include <linux/seq_file.h>
#include <linux/spinlock.h>

#include "nvsim.h"

#define CREATE_TRACE_POINTS
#include "trace.h"

/* Pending work per group is capped: a submission past it is refused. */
#define NVSIM_MAX_PENDING_NS	(10 * NSEC_PER_SEC)
/* Longest slice the engine honours (SET_TIMESLICE takes any u64). */
#define NVSIM_MAX_SLICE_US	(10 * USEC_PER_SEC)
/* Overrun a group may owe, in slices (it bounds the skips of one pick). */
#define NVSIM_MAX_DEBT_SLICES	8
/*
 * Timeslice bounds.  NVIDIA's kfifoChannelGroupSetTimeslice_IMPL
 * (src/nvidia/src/kernel/gpu/fifo/kernel_fifo.c) refuses a timeslice below
 * kfifoRunlistGetMinTimeSlice_HAL() with NV_ERR_NOT_SUPPORTED and changes
 * nothing; that HAL is 0 on the chips of the open modules
 * (src/nvidia/generated/g_kernel_fifo_nvoc.h), and the physical RM's own
 * check runs in GSP firmware.  nvsim's minimum is 1 us (a slice of 0 would
 * never run anything), with the same status.  There is no maximum status:
 * ctrla06c.h says the value is rounded down to one the hardware takes, and
 * GET_TIMESLICE returns the value set; the engine runs at most
 * NVSIM_MAX_SLICE_US of it.
 */
#define NVSIM_MIN_TIMESLICE_US	1
/* Bound on ctxsw_us: a context switch is tens of us; 100 ms is absurd. */
#define NVSIM_MAX_CTXSW_US	100000

#define NVSIM_PROC_DIR		"driver/nvsim"

/*
 * Cost of a PREEMPT's context switch: the engine runs nothing meanwhile.
 * 50 us is in the range published for NVIDIA compute preemption (GPreempt,
 * ATC'25: under 40 us; XSched, OSDI'25: 32 us p99) plus the restart.
 */
static unsigned int nvsim_ctxsw_us = 50;
module_param_named(ctxsw_us, nvsim_ctxsw_us, uint, 0444);
MODULE_PARM_DESC(ctxsw_us, "Context switch time of a PREEMPT, in us (default 50, at most 100000)");

/*
 * One GPU's engine.  @lock protects everything below it and, for each
 * group on @groups, the group's node, enabled, timeslice_us, level,
 * high_block and its counters (pending_ns, busy_ns, wait_ns, debt_ns,
 * preempts, ready_ns and the wake_* fields).  It is a spinlock, taken from process context only
 * (ioctls, proc reads, the kthread), never held while sleeping; it nests
 * inside nvsim_lock.
 */
struct nvsim_engine {
	struct task_struct *task;
	spinlock_t lock;		/* see above */
	struct list_head groups;	/* runlist order: order of creation */
	/* Per interleave level: the node of its last turn, or &groups. */
	struct list_head *cursor[NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH + 1];
	struct nvsim_group *running;	/* NULL: idle */
	struct nvsim_group *last;	/* last group run; for switches */
	ktime_t mark;			/* time charged up to */
	ktime_t slice_end;		/* of the running group */
	ktime_t switch_end;		/* of a PREEMPT's context switch */
	bool kick;			/* the kthread must pick again */
	u64 busy_ns;
	u64 idle_ns;
	u64 switch_ns;			/* in PREEMPT context switches */
	u64 switches;
	u64 preempts;
	u64 high_block;			/* HIGH block now due or running */
	u32 mediums_run;		/* MEDIUM slices since the last LOW one */
	/*
	 * The kthread's timer wake-ups, and how late it ran after each
	 * deadline (timer and scheduling latency of the host: a slice that
	 * ends late delays the group waiting for it by as much).
	 */
	u64 timer_wakes;
	u64 late_sum_ns;
	u64 late_max_ns;
	u64 late_1ms;			/* wake-ups more than 1 ms late */
};

static struct nvsim_engine nvsim_engines[NVSIM_MAX_GPUS];

static bool nvsim_group_runnable(const struct nvsim_group *g)
{
	return g->enabled && g->pending_ns;
}

static u64 nvsim_group_slice_ns(const struct nvsim_group *g)
{
	return min_t(u64, g->timeslice_us, NVSIM_MAX_SLICE_US) * NSEC_PER_USEC;
}

/* @g gets engine time from @start: ends a submit-to-run wait; eng->lock. */
static void nvsim_group_woken(struct nvsim_group *g, ktime_t start)
{
	u64 lat = 0;

	if (!g->waking)
		return;
	if (ktime_after(start, g->wake_at))
		lat = ktime_to_ns(ktime_sub(start, g->wake_at));
	g->waking = false;
	g->wake_sum_ns += lat;
	g->wake_n++;
	g->wake_max_ns = max(g->wake_max_ns, lat);
}

/* Charges the time since eng->mark; eng->lock. */
static void nvsim_engine_charge(struct nvsim_engine *eng)
{
	ktime_t now = ktime_get();
	ktime_t from = eng->mark;
	struct nvsim_group *g = eng->running, *w;
	u64 delta = 0, sw = 0, work = 0;

	if (ktime_after(now, eng->mark))
		delta = ktime_to_ns(ktime_sub(now, eng->mark));
	if (ktime_after(eng->switch_end, eng->mark))
		sw = min_t(u64, delta,
			   ktime_to_ns(ktime_sub(eng->switch_end, eng->mark)));
	eng->mark = now;
	if (g) {
		work = min(delta - sw, g->pending_ns);
		/* Work given to the group holding the engine runs at once. */
		if (work)
			nvsim_group_woken(g, ktime_add_ns(from, sw));
		g->pending_ns -= work;
		g->busy_ns += work;
		if (work && !g->pending_ns)
			trace_nvsim_group_work(g->hclient, g->hgroup, 0);
	}
	eng->switch_ns += sw;
	eng->busy_ns += work;
	eng->idle_ns += delta - sw - work;
	list_for_each_entry(w, &eng->groups, node) {
		if (!w->pending_ns || w == g)
			continue;
		if (w->enabled)
			w->ready_ns += delta;
		else
			w->wait_ns += delta;
	}
}

/* Asks the kthread to pick again; eng->lock. */
static void nvsim_engine_kick(struct nvsim_engine *eng)
{
	WRITE_ONCE(eng->kick, true);
	wake_up_process(eng->task);
}

/*
 * The first runnable group at @level after the level's cursor, round the
 * list; HIGH ones only if not yet in @block.  eng->lock.
 */
static struct nvsim_group *nvsim_engine_first_runnable(struct nvsim_engine *eng,
						       u32 level, u64 block)
{
	struct list_head *start = eng->cursor[level], *pos = start;
	struct nvsim_group *g;

	do {
		pos = pos->next;
		if (pos == &eng->groups)
			continue;
		g = list_entry(pos, struct nvsim_group, node);
		if (g->level == level && nvsim_group_runnable(g) &&
		    (level != NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH ||
		     g->high_block != block))
			return g;
	} while (pos != start);
	return NULL;
}

/* @g takes its turn: its level's cursor moves to it.  eng->lock. */
static struct nvsim_group *nvsim_engine_turn(struct nvsim_engine *eng,
					     struct nvsim_group *g)
{
	eng->cursor[g->level] = &g->node;
	return g;
}

static u32 nvsim_engine_count(struct nvsim_engine *eng, u32 level)
{
	struct nvsim_group *g;
	u32 n = 0;

	list_for_each_entry(g, &eng->groups, node)
		n += g->level == level;
	return n;
}

/*
 * The next group to get a turn by interleave level (see the top of the
 * file), its turn taken: HIGH groups not yet run in this block, else the
 * lower group due (which opens the next block), else a new block of HIGH
 * groups.  eng->lock.
 */
static struct nvsim_group *nvsim_engine_next(struct nvsim_engine *eng)
{
	const u32 high = NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH;
	const u32 med = NVA06C_CTRL_INTERLEAVE_LEVEL_MEDIUM;
	const u32 low = NVA06C_CTRL_INTERLEAVE_LEVEL_LOW;
	struct nvsim_group *g;
	bool low_due;

	g = nvsim_engine_first_runnable(eng, high, eng->high_block);
	if (g) {
		g->high_block = eng->high_block;
		return nvsim_engine_turn(eng, g);
	}
	low_due = eng->mediums_run >= nvsim_engine_count(eng, med);
	g = nvsim_engine_first_runnable(eng, low_due ? low : med, 0);
	if (!g)
		g = nvsim_engine_first_runnable(eng, low_due ? med : low, 0);
	if (g) {
		eng->high_block++;
		eng->mediums_run = g->level == med ? eng->mediums_run + 1 : 0;
		return nvsim_engine_turn(eng, g);
	}
	g = nvsim_engine_first_runnable(eng, high, ++eng->high_block);
	if (!g)
		return NULL;
	g->high_block = eng->high_block;
	return nvsim_engine_turn(eng, g);
}

/*
 * The group to run from now, charged up to now, and until when; NULL when
 * none is runnable or a context switch is in progress (then *until is its
 * end; else KTIME_MAX).  The running group keeps the rest of its slice
 * while it has work; otherwise the next runnable group in runlist order
 * starts a new slice.  eng->lock.
 */
static struct nvsim_group *nvsim_engine_pick(struct nvsim_engine *eng,
					     ktime_t *until)
{
	struct nvsim_group *g = eng->running;
	ktime_t now = eng->mark;
	u64 slice;

	*until = KTIME_MAX;
	if (!g && ktime_before(now, eng->switch_end)) {
		*until = eng->switch_end;
		return NULL;
	}
	if (g) {
		if (nvsim_group_runnable(g) && ktime_before(now, eng->slice_end))
			goto run;
		if (!ktime_before(now, eng->slice_end))
			g->debt_ns += ktime_to_ns(ktime_sub(now, eng->slice_end));
		eng->running = NULL;
	}

	/* Each pass skips a turn and pays a slice of debt: it ends. */
	for (;;) {
		g = nvsim_engine_next(eng);
		if (!g)
			return NULL;
		slice = nvsim_group_slice_ns(g);
		g->debt_ns = min(g->debt_ns, NVSIM_MAX_DEBT_SLICES * slice);
		if (g->debt_ns < slice)
			break;
		g->debt_ns -= slice;
	}

	if (g != eng->last)
		eng->switches++;
	eng->last = g;
	eng->running = g;
	eng->slice_end = ktime_add_ns(now, slice - g->debt_ns);
	g->debt_ns = 0;
run:
	nvsim_group_woken(g, now);
	*until = ktime_add_ns(now, g->pending_ns);
	if (ktime_before(eng->slice_end, *until))
		*until = eng->slice_end;
	return g;
}

/*
 * Starts the next runnable group when none runs, and has the kthread sleep
 * to its deadline.  eng->lock, charged.
 */
static void nvsim_engine_resched(struct nvsim_engine *eng)
{
	ktime_t until;

	if (!eng->running && nvsim_engine_pick(eng, &until))
		nvsim_engine_kick(eng);
}

/*
 * Sleeps until @until (NULL: no limit), a kick or kthread_stop().  Returns
 * how late the kthread ran after @until when its timer woke it, else -1.
 */
static s64 nvsim_engine_sleep(struct nvsim_engine *eng, ktime_t *until)
{
	s64 late = -1;

	for (;;) {
		set_current_state(TASK_INTERRUPTIBLE);
		if (READ_ONCE(eng->kick) || kthread_should_stop())
			break;
		if (!until) {
			schedule();
		} else if (!schedule_hrtimeout_range(until, 0, HRTIMER_MODE_ABS)) {
			late = ktime_to_ns(ktime_sub(ktime_get(), *until));
			break;
		}
	}
	__set_current_state(TASK_RUNNING);
	return late;
}

/* eng->lock. */
static void nvsim_engine_note_late(struct nvsim_engine *eng, s64 late)
{
	eng->timer_wakes++;
	eng->late_sum_ns += late;
	eng->late_max_ns = max_t(u64, eng->late_max_ns, late);
	if (late > NSEC_PER_MSEC)
		eng->late_1ms++;
}

static int nvsim_engine_thread(void *data)
{
	struct nvsim_engine *eng = data;
	struct nvsim_group *g;
	ktime_t until;
	s64 late = -1;

	while (!kthread_should_stop()) {
		spin_lock(&eng->lock);
		if (late >= 0)
			nvsim_engine_note_late(eng, late);
		nvsim_engine_charge(eng);
		WRITE_ONCE(eng->kick, false);
		g = nvsim_engine_pick(eng, &until);
		spin_unlock(&eng->lock);
		late = nvsim_engine_sleep(eng, until != KTIME_MAX ? &until : NULL);
	}
	return 0;
}

/* ---- channel groups (called under nvsim_lock) ---- */

void nvsim_group_add(struct nvsim_group *g, const struct nvsim_gpu *gpu,
		     u32 hclient, u32 hgroup, pid_t tgid)
{
	struct nvsim_engine *eng = &nvsim_engines[gpu->index];

	g->eng = eng;
	g->hclient = hclient;
	g->hgroup = hgroup;
	g->tgid = tgid;
	g->enabled = true;
	g->timeslice_us = NVA06C_DEFAULT_TIMESLICE_US;
	g->level = NVA06C_CTRL_INTERLEAVE_LEVEL_MEDIUM;
	g->high_block = 0;
	g->pending_ns = 0;
	g->busy_ns = 0;
	g->wait_ns = 0;
	g->debt_ns = 0;
	g->preempts = 0;
	g->ready_ns = 0;
	g->waking = false;
	g->wake_sum_ns = 0;
	g->wake_n = 0;
	g->wake_max_ns = 0;
	spin_lock(&eng->lock);
	list_add_tail(&g->node, &eng->groups);
	spin_unlock(&eng->lock);
}

/* Takes the group off its engine; after this the engine never sees it. */
void nvsim_group_remove(struct nvsim_group *g)
{
	struct nvsim_engine *eng = g->eng;
	unsigned int level;

	spin_lock(&eng->lock);
	nvsim_engine_charge(eng);
	if (g->pending_ns)
		trace_nvsim_group_work(g->hclient, g->hgroup, 0);
	for (level = 0; level < ARRAY_SIZE(eng->cursor); level++)
		if (eng->cursor[level] == &g->node)
			eng->cursor[level] = g->node.prev;
	list_del(&g->node);
	if (eng->last == g)
		eng->last = NULL;
	if (eng->running == g) {
		eng->running = NULL;
		nvsim_engine_resched(eng);
	}
	spin_unlock(&eng->lock);
}

void nvsim_group_set_enabled(struct nvsim_group *g, bool enabled)
{
	struct nvsim_engine *eng = g->eng;

	spin_lock(&eng->lock);
	nvsim_engine_charge(eng);
	g->enabled = enabled;
	if (eng->running == g && !enabled)
		eng->running = NULL;
	nvsim_engine_resched(eng);
	spin_unlock(&eng->lock);
}

/* Takes effect at the group's next slice; bounds: NVSIM_MIN_TIMESLICE_US. */
u32 nvsim_group_set_timeslice(struct nvsim_group *g, u64 us)
{
	if (us < NVSIM_MIN_TIMESLICE_US)
		return NV_ERR_NOT_SUPPORTED;
	spin_lock(&g->eng->lock);
	g->timeslice_us = us;
	spin_unlock(&g->eng->lock);
	return NV_OK;
}

/*
 * SET_INTERLEAVE_LEVEL: NV_ERR_INVALID_ARGUMENT for a level that is none
 * of the three (kchangrpSetInterleaveLevel_IMPL); the access right is the
 * caller's to check.  Takes effect at the next pick.
 */
u32 nvsim_group_set_level(struct nvsim_group *g, u32 level)
{
	if (level > NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH)
		return NV_ERR_INVALID_ARGUMENT;
	spin_lock(&g->eng->lock);
	if (level == NVA06C_CTRL_INTERLEAVE_LEVEL_HIGH && g->level != level)
		g->high_block = g->eng->high_block - 1;	/* due in this block */
	g->level = level;
	spin_unlock(&g->eng->lock);
	return NV_OK;
}

/*
 * NVA06C_CTRL_CMD_PREEMPT.  The params as ctrla06c.h defines them: a
 * manual timeout above NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US is
 * NV_ERR_INVALID_ARGUMENT, one of the statuses it lists (the open kernel
 * RM only exports the control, g_kernel_channel_group_api_nvoc.c; its
 * checks are not in the open sources).
 * The preemption is done when this returns, so bWait has nothing to wait
 * for.  Only the running group is taken off; any other is NV_OK untouched.
 */
u32 nvsim_group_preempt(struct nvsim_group *g,
			const struct nva06c_preempt_params *p)
{
	struct nvsim_engine *eng = g->eng;

	if (p->b_manual_timeout &&
	    p->timeout_us > NVA06C_CTRL_CMD_PREEMPT_MAX_MANUAL_TIMEOUT_US)
		return NV_ERR_INVALID_ARGUMENT;
	spin_lock(&eng->lock);
	nvsim_engine_charge(eng);
	if (eng->running == g) {
		g->preempts++;
		eng->preempts++;
		eng->running = NULL;
		eng->switch_end = ktime_add_us(eng->mark, nvsim_ctxsw_us);
		nvsim_engine_kick(eng);
	}
	spin_unlock(&eng->lock);
	return NV_OK;
}

u64 nvsim_group_timeslice(struct nvsim_group *g)
{
	u64 us;

	spin_lock(&g->eng->lock);
	us = g->timeslice_us;
	spin_unlock(&g->eng->lock);
	return us;
}

/*
 * Queues @ns of work.  Zero is an invalid argument; pending work past
 * NVSIM_MAX_PENDING_NS is refused whole with NV_ERR_INSUFFICIENT_RESOURCES.
 */
u32 nvsim_group_submit(struct nvsim_group *g, u64 ns)
{
	struct nvsim_engine *eng = g->eng;
	u32 st = NV_OK;

	if (!ns)
		return NV_ERR_INVALID_ARGUMENT;
	spin_lock(&eng->lock);
	nvsim_engine_charge(eng);
	if (ns > NVSIM_MAX_PENDING_NS - g->pending_ns) {
		st = NV_ERR_INSUFFICIENT_RESOURCES;
	} else {
		if (!g->pending_ns) {
			g->wake_at = eng->mark;
			g->waking = true;
		}
		g->pending_ns += ns;
		trace_nvsim_group_work(g->hclient, g->hgroup, g->pending_ns);
		nvsim_engine_resched(eng);
	}
	spin_unlock(&eng->lock);
	return st;
}

void nvsim_group_stats(struct nvsim_group *g, struct nvsim_work_stats_params *p)
{
	struct nvsim_engine *eng = g->eng;

	spin_lock(&eng->lock);
	nvsim_engine_charge(eng);
	p->busy_ns = g->busy_ns;
	p->pending_ns = g->pending_ns;
	p->b_enabled = g->enabled;
	p->timeslice_us = min_t(u64, g->timeslice_us, U32_MAX);
	spin_unlock(&eng->lock);
}

/* ---- /proc/driver/nvsim ---- */

static int nvsim_groups_show(struct seq_file *m, void *v)
{
	struct nvsim_group *g;
	unsigned int i;

	seq_puts(m, "gpu client group tgid enabled timeslice_us pending_ns busy_ns wait_ns preempts ready_ns wake_sum_ns wake_n wake_max_ns level\n");
	for (i = 0; i < nvsim_ngpus; i++) {
		struct nvsim_engine *eng = &nvsim_engines[i];

		spin_lock(&eng->lock);
		nvsim_engine_charge(eng);
		list_for_each_entry(g, &eng->groups, node)
			seq_printf(m, "%u 0x%x 0x%x %d %d %llu %llu %llu %llu %llu %llu %llu %llu %llu %u\n",
				   i, g->hclient, g->hgroup, g->tgid, g->enabled,
				   g->timeslice_us, g->pending_ns, g->busy_ns,
				   g->wait_ns, g->preempts, g->ready_ns,
				   g->wake_sum_ns, g->wake_n, g->wake_max_ns,
				   g->level);
		spin_unlock(&eng->lock);
	}
	return 0;
}

static int nvsim_engines_show(struct seq_file *m, void *v)
{
	unsigned int i;

	seq_puts(m, "gpu busy_ns idle_ns switches switch_ns preempts timer_wakes late_sum_ns late_max_ns late_1ms\n");
	for (i = 0; i < nvsim_ngpus; i++) {
		struct nvsim_engine *eng = &nvsim_engines[i];

		spin_lock(&eng->lock);
		nvsim_engine_charge(eng);
		seq_printf(m, "%u %llu %llu %llu %llu %llu %llu %llu %llu %llu\n",
			   i, eng->busy_ns, eng->idle_ns, eng->switches,
			   eng->switch_ns, eng->preempts, eng->timer_wakes,
			   eng->late_sum_ns, eng->late_max_ns, eng->late_1ms);
		spin_unlock(&eng->lock);
	}
	return 0;
}

/* ---- module ---- */

/* Stops the first @n kthreads. */
static void nvsim_engine_stop(unsigned int n)
{
	while (n--)
		kthread_stop(nvsim_engines[n].task);
}

int nvsim_engine_init(void)
{
	struct proc_dir_entry *dir;
	unsigned int i, j;
	int ret;

	if (nvsim_ctxsw_us > NVSIM_MAX_CTXSW_US)
		return -EINVAL;
	for (i = 0; i < nvsim_ngpus; i++) {
		struct nvsim_engine *eng = &nvsim_engines[i];

		spin_lock_init(&eng->lock);
		INIT_LIST_HEAD(&eng->groups);
		for (j = 0; j < ARRAY_SIZE(eng->cursor); j++)
			eng->cursor[j] = &eng->groups;
		eng->mark = ktime_get();
		eng->task = kthread_create(nvsim_engine_thread, eng,
					   "nvsim-engine/%u", i);
		if (IS_ERR(eng->task)) {
			ret = PTR_ERR(eng->task);
			goto err_threads;
		}
		/* Hardware does not wait for the CPU: slices end on time. */
		sched_set_fifo_low(eng->task);
		wake_up_process(eng->task);
	}

	dir = proc_mkdir(NVSIM_PROC_DIR, NULL);
	if (!dir) {
		ret = -ENOMEM;
		goto err_threads;
	}
	if (!proc_create_single("groups", 0444, dir, nvsim_groups_show) ||
	    !proc_create_single("engines", 0444, dir, nvsim_engines_show)) {
		ret = -ENOMEM;
		goto err_proc;
	}
	return 0;

err_proc:
	remove_proc_subtree(NVSIM_PROC_DIR, NULL);
err_threads:
	nvsim_engine_stop(i);
	return ret;
}

/* At module exit: every file is closed, so every group is gone. */
void nvsim_engine_exit(void)
{
	remove_proc_subtree(NVSIM_PROC_DIR, NULL);
	nvsim_engine_stop(nvsim_ngpus);
}
