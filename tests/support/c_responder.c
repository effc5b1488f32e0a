// SPDX-License-Identifier: GPL-2.0
/*
 * c_responder: a minimal responder for the vgpu upcall protocol.
 *
 * Registers with the vgpu module over generic netlink, optionally installs a
 * filter, then answers every upcall with one fixed verdict and ignores
 * events. It is the "minimal C responder" of the benchmark and a test tool.
 *
 *   gcc -O2 -Wall -I kmod/include/uapi -o c_responder tests/support/c_responder.c
 *
 *   c_responder [-f RULE]... [-P] [-W] [-O] [-M] [-a ACTION] [-D USEC] [-c COUNT]
 *               [-V VERSION] [-F] [-S] [-v]
 *
 *   -f RULE    add a filter rule NODES:NR:SIZE:MATCH_OFF:PTR_OFF:LEN_OFF:KEYS
 *              NODES: ctl, gpu, uvm joined by '+', or a number (node_mask);
 *              offsets: a number or '-' for none; KEYS: comma separated.
 *              Example, "class 0x40 allocs": -f ctl:0x2b:0:12:-:-:0x40
 *   -P         rules ask for POST events (VGPU_RULE_F_POST)
 *   -W         rules ask for shadow calls (VGPU_RULE_F_SHADOW)
 *   -O         upcall every open (VGPU_FILTER_OPEN)
 *   -M         upcall every mmap of nvidia-uvm (VGPU_FILTER_UVM_MMAP)
 *   -F         register, install the filter and exit (the filter stays)
 *   -a ACTION  allow (default), deny=ERRNO, status=STATUS@OFFSET, ignore
 *              (never answer), post (ALLOW with VGPU_VERDICT_F_POST, and
 *              ALLOW to the POST upcalls that follow), post-ignore (the
 *              same, never answering the POST upcalls)
 *              A POST upcall is always answered ALLOW (post-ignore: not
 *              at all); OPEN and MMAP upcalls get ALLOW for status= and
 *              post.
 *   -D USEC    wait before answering
 *   -c COUNT   exit after answering COUNT upcalls
 *   -V VERSION register with this protocol version (default: the header's)
 *   -S         print the module's counters and exit
 *   -v         print one line per upcall and event on stdout
 *
 * Prints "ready" on stdout once registered (and the filter set).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#include <linux/genetlink.h>
#include <linux/netlink.h>
#include <linux/vgpu.h>

#define BUF_SIZE (64 * 1024)

static int nl_fd;
static uint16_t family;
static uint32_t seq = 1;
static int verbose;

static struct vgpu_rule rules[VGPU_RULES_MAX];
static unsigned int n_rules;
static uint32_t rule_flags;

static void die(const char *what)
{
	perror(what);
	exit(1);
}

/* Builds and sends one genl request; attrs given as (type, len, data). */
struct attr {
	uint16_t type;
	uint16_t len;
	const void *data;
};

static int nl_send(uint16_t type, uint16_t flags, uint8_t cmd, uint8_t ver,
		   const struct attr *a, int n)
{
	static char buf[BUF_SIZE];
	struct nlmsghdr *nlh = (struct nlmsghdr *)buf;
	struct genlmsghdr *g;
	size_t off;
	int i;

	memset(buf, 0, NLMSG_HDRLEN + GENL_HDRLEN);
	nlh->nlmsg_type = type;
	nlh->nlmsg_flags = NLM_F_REQUEST | flags;
	nlh->nlmsg_seq = seq++;
	g = NLMSG_DATA(nlh);
	g->cmd = cmd;
	g->version = ver;
	off = NLMSG_HDRLEN + GENL_HDRLEN;
	for (i = 0; i < n; i++) {
		struct nlattr *na = (struct nlattr *)(buf + off);

		if (off + NLA_HDRLEN + NLA_ALIGN(a[i].len) > sizeof(buf))
			return -EMSGSIZE;
		na->nla_type = a[i].type;
		na->nla_len = NLA_HDRLEN + a[i].len;
		memcpy(buf + off + NLA_HDRLEN, a[i].data, a[i].len);
		memset(buf + off + NLA_HDRLEN + a[i].len, 0,
		       NLA_ALIGN(a[i].len) - a[i].len);
		off += NLA_HDRLEN + NLA_ALIGN(a[i].len);
	}
	nlh->nlmsg_len = off;
	if (send(nl_fd, buf, off, 0) < 0)
		return -errno;
	return 0;
}

/* Finds attribute @type in a genl message; returns its payload or NULL. */
static void *nl_attr(struct nlmsghdr *nlh, uint16_t type, int *len)
{
	char *p = (char *)NLMSG_DATA(nlh) + GENL_HDRLEN;
	char *end = (char *)nlh + nlh->nlmsg_len;

	while (p + NLA_HDRLEN <= end) {
		struct nlattr *na = (struct nlattr *)p;

		if (na->nla_len < NLA_HDRLEN || p + na->nla_len > end)
			break;
		if ((na->nla_type & NLA_TYPE_MASK) == type) {
			if (len)
				*len = na->nla_len - NLA_HDRLEN;
			return p + NLA_HDRLEN;
		}
		p += NLA_ALIGN(na->nla_len);
	}
	return NULL;
}

/*
 * Waits for the answer to the last request: returns 0 or -errno from the ack,
 * and copies a data reply (if any) into @reply.
 */
static int nl_wait(void *reply, size_t size)
{
	static char buf[BUF_SIZE];
	int got_reply = 0;

	for (;;) {
		ssize_t n = recv(nl_fd, buf, sizeof(buf), 0);
		struct nlmsghdr *nlh;

		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		for (nlh = (struct nlmsghdr *)buf; NLMSG_OK(nlh, n);
		     nlh = NLMSG_NEXT(nlh, n)) {
			if (nlh->nlmsg_type == NLMSG_ERROR) {
				struct nlmsgerr *e = NLMSG_DATA(nlh);

				return e->error;
			}
			if (nlh->nlmsg_seq != seq - 1)
				continue;	/* an upcall or event */
			if (reply && !got_reply) {
				memcpy(reply, nlh, nlh->nlmsg_len < size ?
				       nlh->nlmsg_len : size);
				got_reply = 1;
			}
		}
	}
}

static int resolve_family(void)
{
	static char reply[4096];
	struct attr a = { CTRL_ATTR_FAMILY_NAME, sizeof(VGPU_GENL_NAME),
			  VGPU_GENL_NAME };
	uint16_t *id;
	int err;

	err = nl_send(GENL_ID_CTRL, NLM_F_ACK, CTRL_CMD_GETFAMILY, 1, &a, 1);
	if (!err)
		err = nl_wait(reply, sizeof(reply));
	if (err) {
		fprintf(stderr, "c_responder: family %s: %s (is vgpu.ko loaded?)\n",
			VGPU_GENL_NAME, strerror(-err));
		return err;
	}
	id = nl_attr((struct nlmsghdr *)reply, CTRL_ATTR_FAMILY_ID, NULL);
	if (!id)
		return -ENOENT;
	family = *id;
	return 0;
}

static int request(uint8_t cmd, const struct attr *a, int n, void *reply,
		   size_t size)
{
	int err = nl_send(family, NLM_F_ACK, cmd, VGPU_GENL_VERSION, a, n);

	return err ? err : nl_wait(reply, size);
}

static uint32_t parse_num(const char *s)
{
	if (!strcmp(s, "-") || !strcmp(s, "none"))
		return VGPU_OFF_NONE;
	return strtoul(s, NULL, 0);
}

static uint32_t parse_nodes(const char *s)
{
	uint32_t mask = 0;
	char *copy = strdup(s), *tok, *save;

	for (tok = strtok_r(copy, "+", &save); tok;
	     tok = strtok_r(NULL, "+", &save)) {
		if (!strcmp(tok, "ctl"))
			mask |= 1U << VGPU_NODE_CTL;
		else if (!strcmp(tok, "gpu"))
			mask |= 1U << VGPU_NODE_GPU;
		else if (!strcmp(tok, "uvm"))
			mask |= 1U << VGPU_NODE_UVM;
		else
			mask |= strtoul(tok, NULL, 0);
	}
	free(copy);
	return mask;
}

static void parse_rule(const char *spec)
{
	char *copy = strdup(spec), *f[7], *save, *k;
	struct vgpu_rule *r;
	int i;

	if (n_rules >= VGPU_RULES_MAX) {
		fprintf(stderr, "c_responder: too many rules\n");
		exit(2);
	}
	r = &rules[n_rules++];
	memset(r, 0, sizeof(*r));
	for (i = 0; i < 7; i++) {
		f[i] = strtok_r(i ? NULL : copy, ":", &save);
		if (!f[i] && i < 6) {
			fprintf(stderr, "c_responder: bad rule %s\n", spec);
			exit(2);
		}
	}
	r->node_mask = parse_nodes(f[0]);
	r->nr = parse_num(f[1]);
	r->size = parse_num(f[2]);
	r->match_off = parse_num(f[3]);
	r->ptr_off = parse_num(f[4]);
	r->len_off = parse_num(f[5]);
	if (f[6]) {
		for (k = strtok_r(f[6], ",", &save); k && r->n_match <
		     VGPU_RULE_MATCH_MAX; k = strtok_r(NULL, ",", &save))
			r->match[r->n_match++] = strtoul(k, NULL, 0);
	}
	free(copy);
}

static void print_stats(void)
{
	static char reply[4096];
	struct vgpu_stats s;
	void *p;
	int err, len;

	err = request(VGPU_CMD_GET_STATS, NULL, 0, reply, sizeof(reply));
	if (err) {
		fprintf(stderr, "c_responder: GET_STATS: %s\n", strerror(-err));
		exit(1);
	}
	p = nl_attr((struct nlmsghdr *)reply, VGPU_A_STATS, &len);
	if (!p || len != sizeof(s)) {
		fprintf(stderr, "c_responder: bad stats reply\n");
		exit(1);
	}
	memcpy(&s, p, sizeof(s));
	printf("version %u\ndaemon_portid %u\ncontexts %llu\nopens %llu\n"
	       "ioctls %llu\nupcalls %llu\nverdicts %llu\ntimeouts %llu\n"
	       "lost %llu\nfail_open %llu\nfail_closed %llu\nkilled %llu\n"
	       "events %llu\nevents_lost %llu\nbad_verdicts %llu\nmmaps %llu\n",
	       s.version, s.daemon_portid, (unsigned long long)s.contexts,
	       (unsigned long long)s.opens, (unsigned long long)s.ioctls,
	       (unsigned long long)s.upcalls, (unsigned long long)s.verdicts,
	       (unsigned long long)s.timeouts, (unsigned long long)s.lost,
	       (unsigned long long)s.fail_open,
	       (unsigned long long)s.fail_closed,
	       (unsigned long long)s.killed, (unsigned long long)s.events,
	       (unsigned long long)s.events_lost,
	       (unsigned long long)s.bad_verdicts,
	       (unsigned long long)s.mmaps);
}

int main(int argc, char **argv)
{
	static char buf[BUF_SIZE];
	struct vgpu_verdict answer = { .action = VGPU_VERDICT_ALLOW };
	uint32_t version = VGPU_PROTO_VERSION, filter_flags = 0;
	long delay_us = 0, count = -1, answered = 0;
	int filter_only = 0, stats = 0, ignore = 0, have_filter = 0;
	int ignore_post = 0;
	int opt, err, rcvbuf = 4 << 20;
	unsigned int i;
	struct sockaddr_nl sa = { .nl_family = AF_NETLINK };

	while ((opt = getopt(argc, argv, "f:PWOMa:D:c:V:FSv")) != -1) {
		switch (opt) {
		case 'f':
			parse_rule(optarg);
			have_filter = 1;
			break;
		case 'P':
			rule_flags |= VGPU_RULE_F_POST;
			break;
		case 'W':
			rule_flags |= VGPU_RULE_F_SHADOW;
			break;
		case 'O':
			filter_flags |= VGPU_FILTER_OPEN;
			have_filter = 1;
			break;
		case 'M':
			filter_flags |= VGPU_FILTER_UVM_MMAP;
			have_filter = 1;
			break;
		case 'a':
			if (!strcmp(optarg, "allow")) {
				answer.action = VGPU_VERDICT_ALLOW;
			} else if (!strncmp(optarg, "deny=", 5)) {
				answer.action = VGPU_VERDICT_DENY;
				answer.error = strtoul(optarg + 5, NULL, 0);
			} else if (!strncmp(optarg, "status=", 7)) {
				char *at = strchr(optarg, '@');

				answer.action = VGPU_VERDICT_FAIL_STATUS;
				answer.status = strtoul(optarg + 7, NULL, 0);
				answer.status_off = at ? strtoul(at + 1, NULL, 0) : 0;
			} else if (!strcmp(optarg, "ignore")) {
				ignore = 1;
			} else if (!strcmp(optarg, "post") ||
				   !strcmp(optarg, "post-ignore")) {
				answer.action = VGPU_VERDICT_ALLOW;
				answer.flags = VGPU_VERDICT_F_POST;
				ignore_post = !strcmp(optarg, "post-ignore");
			} else {
				fprintf(stderr, "c_responder: bad action %s\n", optarg);
				return 2;
			}
			break;
		case 'D':
			delay_us = strtol(optarg, NULL, 0);
			break;
		case 'c':
			count = strtol(optarg, NULL, 0);
			break;
		case 'V':
			version = strtoul(optarg, NULL, 0);
			break;
		case 'F':
			filter_only = 1;
			break;
		case 'S':
			stats = 1;
			break;
		case 'v':
			verbose = 1;
			break;
		default:
			return 2;
		}
	}
	setvbuf(stdout, NULL, _IOLBF, 0);

	nl_fd = socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_GENERIC);
	if (nl_fd < 0)
		die("socket");
	setsockopt(nl_fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
	if (bind(nl_fd, (struct sockaddr *)&sa, sizeof(sa)) < 0)
		die("bind");
	if (resolve_family())
		return 1;
	if (stats) {
		print_stats();
		return 0;
	}
	/* SET_FILTER is the registered daemon's only: -F registers too. */
	{
		struct attr a = { VGPU_A_VERSION, 4, &version };

		err = request(VGPU_CMD_REGISTER, &a, 1, NULL, 0);
		if (err) {
			fprintf(stderr, "c_responder: REGISTER: %s\n", strerror(-err));
			return 1;
		}
	}
	for (i = 0; i < n_rules; i++)
		rules[i].flags = rule_flags;
	if (have_filter || filter_only) {
		struct attr a[2] = {
			{ VGPU_A_FILTER_FLAGS, 4, &filter_flags },
			{ VGPU_A_RULES, n_rules * sizeof(struct vgpu_rule), rules },
		};

		err = request(VGPU_CMD_SET_FILTER, a, 2, NULL, 0);
		if (err) {
			fprintf(stderr, "c_responder: SET_FILTER: %s\n", strerror(-err));
			return 1;
		}
	}
	if (filter_only)
		return 0;
	printf("ready\n");

	while (count < 0 || answered < count) {
		ssize_t n = recv(nl_fd, buf, sizeof(buf), 0);
		struct nlmsghdr *nlh;

		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == ENOBUFS) {
				fprintf(stderr, "c_responder: receive queue overrun\n");
				continue;
			}
			die("recv");
		}
		for (nlh = (struct nlmsghdr *)buf; NLMSG_OK(nlh, n);
		     nlh = NLMSG_NEXT(nlh, n)) {
			struct genlmsghdr *g = NLMSG_DATA(nlh);
			struct vgpu_upcall up;
			struct vgpu_event ev;
			struct vgpu_verdict v;
			struct attr a = { VGPU_A_VERDICT, sizeof(v), &v };
			int plen = 0, dlen = 0;
			void *p;

			if (nlh->nlmsg_type == NLMSG_ERROR) {
				struct nlmsgerr *e = NLMSG_DATA(nlh);

				if (e->error && verbose)
					printf("error %d\n", e->error);
				continue;
			}
			if (nlh->nlmsg_type != family)
				continue;
			if (g->cmd == VGPU_CMD_EVENT) {
				p = nl_attr(nlh, VGPU_A_EVENT, NULL);
				if (!p || !verbose)
					continue;
				memcpy(&ev, p, sizeof(ev));
				nl_attr(nlh, VGPU_A_PARAMS, &plen);
				nl_attr(nlh, VGPU_A_DATA, &dlen);
				printf("event kind=%u ctx=%llu upcall=%llu nr=0x%x ret=%d plen=%d dlen=%d\n",
				       ev.kind, (unsigned long long)ev.ctx_id,
				       (unsigned long long)ev.upcall_id, ev.nr,
				       ev.ret, plen, dlen);
				continue;
			}
			if (g->cmd != VGPU_CMD_UPCALL)
				continue;
			p = nl_attr(nlh, VGPU_A_UPCALL, NULL);
			if (!p)
				continue;
			memcpy(&up, p, sizeof(up));
			if (verbose) {
				const char *cg = nl_attr(nlh, VGPU_A_CGROUP, NULL);

				nl_attr(nlh, VGPU_A_PARAMS, &plen);
				nl_attr(nlh, VGPU_A_DATA, &dlen);
				printf("upcall id=%llu kind=%u ctx=%llu node=%u minor=%u nr=0x%x flags=0x%x ret=%d plen=%d dlen=%d pid=%u uid=%u cgroup_id=%llu cgroup=%s\n",
				       (unsigned long long)up.id, up.kind,
				       (unsigned long long)up.ctx_id, up.node,
				       up.minor, up.nr, up.flags, up.ret, plen,
				       dlen, up.pid, up.uid,
				       (unsigned long long)up.cgroup_id,
				       cg ? cg : "-");
			}
			if (ignore || (ignore_post &&
				       up.kind == VGPU_UPCALL_POST))
				continue;
			if (delay_us)
				usleep(delay_us);
			v = answer;
			v.id = up.id;
			/* Answers that only fit an IOCTL upcall. */
			if (up.kind != VGPU_UPCALL_IOCTL &&
			    (v.action == VGPU_VERDICT_FAIL_STATUS || v.flags ||
			     up.kind == VGPU_UPCALL_POST))
				v = (struct vgpu_verdict){ .id = up.id,
					.action = VGPU_VERDICT_ALLOW };
			err = nl_send(family, 0, VGPU_CMD_VERDICT,
				      VGPU_GENL_VERSION, &a, 1);
			if (err)
				fprintf(stderr, "c_responder: VERDICT: %s\n",
					strerror(-err));
			answered++;
		}
	}
	return 0;
}
