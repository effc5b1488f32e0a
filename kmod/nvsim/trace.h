/* SPDX-License-Identifier: GPL-2.0-only */
/*
 * Tracepoints of nvsim (tracefs: events/nvsim/): what a real GPU does not
 * show the kernel, for tests that check probes against nvsim's truth.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM nvsim

#if !defined(_NVSIM_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _NVSIM_TRACE_H

#include <linux/tracepoint.h>

/*
 * A channel group's pending work changed: submitted (@pending_ns, the work
 * now queued), run to the end or freed (@pending_ns 0).
 */
TRACE_EVENT(nvsim_group_work,
	    TP_PROTO(u32 h_client, u32 h_group, u64 pending_ns),
	    TP_ARGS(h_client, h_group, pending_ns),
	    TP_STRUCT__entry(__field(u64, pending_ns)
			     __field(u32, h_client)
			     __field(u32, h_group)),
	    TP_fast_assign(__entry->pending_ns = pending_ns;
			   __entry->h_client = h_client;
			   __entry->h_group = h_group;),
	    TP_printk("client=0x%x group=0x%x pending_ns=%llu",
		      __entry->h_client, __entry->h_group,
		      __entry->pending_ns)
);

#endif /* _NVSIM_TRACE_H */

#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#undef TRACE_INCLUDE_FILE
#define TRACE_INCLUDE_FILE trace
#include <trace/define_trace.h>
