/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Tracepoints of the vgpu module (tracefs: events/vgpu/). eBPF tools attach
 * to them; their fields are part of what those tools read.
 */
#undef TRACE_SYSTEM
#define TRACE_SYSTEM vgpu

#if !defined(_VGPU_TRACE_H) || defined(TRACE_HEADER_MULTI_READ)
#define _VGPU_TRACE_H

#include <linux/tracepoint.h>

TRACE_EVENT(vgpu_ioctl_enter,
	    TP_PROTO(u64 ctx_id, u32 cmd, u32 nr),
	    TP_ARGS(ctx_id, cmd, nr),
	    TP_STRUCT__entry(__field(u64, ctx_id)
			     __field(u32, cmd)
			     __field(u32, nr)),
	    TP_fast_assign(__entry->ctx_id = ctx_id;
			   __entry->cmd = cmd;
			   __entry->nr = nr;),
	    TP_printk("ctx=%llu cmd=0x%x nr=0x%x",
		      __entry->ctx_id, __entry->cmd, __entry->nr)
);

/*
 * @key is what selected the call's rule, read from the module's copy of
 * its params (an object class, a control command, a VID_HEAP function):
 * 0 when no rule selected it. eBPF probes (ebpf/) key histograms by it.
 */
TRACE_EVENT(vgpu_ioctl_exit,
	    TP_PROTO(u64 ctx_id, u32 nr, s64 ret, u32 slow, u32 key),
	    TP_ARGS(ctx_id, nr, ret, slow, key),
	    TP_STRUCT__entry(__field(u64, ctx_id)
			     __field(s64, ret)
			     __field(u32, nr)
			     __field(u32, slow)
			     __field(u32, key)),
	    TP_fast_assign(__entry->ctx_id = ctx_id;
			   __entry->ret = ret;
			   __entry->nr = nr;
			   __entry->slow = slow;
			   __entry->key = key;),
	    TP_printk("ctx=%llu nr=0x%x ret=%lld slow=%u key=0x%x",
		      __entry->ctx_id, __entry->nr, __entry->ret,
		      __entry->slow, __entry->key)
);

TRACE_EVENT(vgpu_upcall_send,
	    TP_PROTO(u64 id, u64 ctx_id, u32 kind, u32 nr),
	    TP_ARGS(id, ctx_id, kind, nr),
	    TP_STRUCT__entry(__field(u64, id)
			     __field(u64, ctx_id)
			     __field(u32, kind)
			     __field(u32, nr)),
	    TP_fast_assign(__entry->id = id;
			   __entry->ctx_id = ctx_id;
			   __entry->kind = kind;
			   __entry->nr = nr;),
	    TP_printk("id=%llu ctx=%llu kind=%u nr=0x%x",
		      __entry->id, __entry->ctx_id, __entry->kind,
		      __entry->nr)
);

/*
 * @action is the verdict's action, or 0 when the upcall got no verdict
 * (then @value is the fail-policy errno, negative).
 */
TRACE_EVENT(vgpu_upcall_verdict,
	    TP_PROTO(u64 id, u32 action, s32 value),
	    TP_ARGS(id, action, value),
	    TP_STRUCT__entry(__field(u64, id)
			     __field(u32, action)
			     __field(s32, value)),
	    TP_fast_assign(__entry->id = id;
			   __entry->action = action;
			   __entry->value = value;),
	    TP_printk("id=%llu action=%u value=%d",
		      __entry->id, __entry->action, __entry->value)
);

/*
 * One SCHEDULE entry applied: @error is 0 or a negative errno, @status the
 * driver's NVIDIA status, @ns how long the entry took (lookup and ioctl).
 * Entries of one message fire in the order they were applied.
 */
TRACE_EVENT(vgpu_schedule,
	    TP_PROTO(u64 ctx_id, u32 h_client, u32 h_object, u32 enable,
		     s32 error, u32 status, u64 ns),
	    TP_ARGS(ctx_id, h_client, h_object, enable, error, status, ns),
	    TP_STRUCT__entry(__field(u64, ctx_id)
			     __field(u64, ns)
			     __field(u32, h_client)
			     __field(u32, h_object)
			     __field(u32, enable)
			     __field(s32, error)
			     __field(u32, status)),
	    TP_fast_assign(__entry->ctx_id = ctx_id;
			   __entry->ns = ns;
			   __entry->h_client = h_client;
			   __entry->h_object = h_object;
			   __entry->enable = enable;
			   __entry->error = error;
			   __entry->status = status;),
	    TP_printk("ctx=%llu client=0x%x object=0x%x enable=%u error=%d status=0x%x ns=%llu",
		      __entry->ctx_id, __entry->h_client, __entry->h_object,
		      __entry->enable, __entry->error, __entry->status,
		      __entry->ns)
);

#endif /* _VGPU_TRACE_H */

#undef TRACE_INCLUDE_PATH
#define TRACE_INCLUDE_PATH .
#undef TRACE_INCLUDE_FILE
#define TRACE_INCLUDE_FILE trace
#include <trace/define_trace.h>
