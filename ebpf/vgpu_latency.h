/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What the latency probes (vgpu_latency.bpf.c) share with the daemon that
 * reads their maps (vgpud/probes/): the histogram key and its values.
 * tests/unit/test_probe_layout.py pins it against vgpud/probes/layout.py.
 *
 * One entry per (context, histogram, call), its value the whole histogram.
 * Every field is a u64 so that the key has no padding (bcc copies keys
 * whole: padding bytes with stale contents would split one histogram).
 */
#ifndef VGPU_LATENCY_H
#define VGPU_LATENCY_H

/* Histograms, the value of vgpu_lat_key.hist. */
#define VGPU_LAT_TOTAL		0	/* the tenant's ioctl through /dev/vgpu */
#define VGPU_LAT_UPCALL		1	/* upcall sent -> verdict, summed per call */
#define VGPU_LAT_DRIVER		2	/* in the backing driver, summed per call */
#define VGPU_LAT_SWITCH		3	/* SCHEDULE received -> the off entry applied */
#define VGPU_LAT_SLOT		4	/* a channel group off with pending work */

/*
 * The call of a histogram: an escape (on nvidia-uvm: its command, with
 * VGPU_LAT_UVM set) and its key. UVM commands are plain integers below
 * 2^31; on the other nodes the escape is _IOC_NR, below 256.
 */
#define VGPU_LAT_UVM		(1U << 31)
/*
 * Escapes above 255 (through IOCTL_XFER_CMD) and UVM commands above 255
 * but UVM_INITIALIZE: a tenant picks those numbers freely, so they share
 * one histogram, and a tenant cannot make one per number and fill the map.
 */
#define VGPU_LAT_NR_OTHER	0x100
#define VGPU_LAT_UVM_INITIALIZE	0x30000001
#define VGPU_LAT_CALL(nr, key)	(((__u64)(key) << 32) | (__u32)(nr))
/* Upcalls outside an ioctl (OPEN, MMAP): the upcall kind, in its own range. */
#define VGPU_LAT_CALL_UPCALL(kind)	(0xffffffff00000000ULL | (__u32)(kind))

/* The daemon's statistics, indices of the array "stats". */
#define VGPU_LAT_STAT_DROPPED	0	/* an event whose map was full */
#define VGPU_LAT_STAT_N		1

/* Buckets of a histogram: bpf_log2l of a u64 is 0..64. */
#define VGPU_LAT_SLOTS		65

/* One histogram: a (context, histogram, call). */
struct vgpu_lat_key {
	__u64 ctx_id;
	__u64 hist;
	__u64 call;
};

/*
 * @slots[k] counts durations by bcc's log2 bucket (bpf_log2l): bucket
 * k > 0 holds 2^(k-1) to 2^k - 1 ns, bucket 1 also 0 ns. @sum_ns is the sum
 * of the durations counted.
 */
struct vgpu_lat_val {
	__u64 slots[VGPU_LAT_SLOTS];
	__u64 sum_ns;
};

#endif /* VGPU_LATENCY_H */
