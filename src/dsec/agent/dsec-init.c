/*
 * dsec-init: the in-sandbox agent, pid 1 of every container sandbox.
 *
 * Why native and single-threaded: density. One of these runs in every idle sandbox, so it
 * must cost a few hundred KiB, not the megabytes of an interpreter. One poll() loop
 * serves any number of connections; the slow or dangerous work happens in forked
 * children so the loop never blocks:
 *
 *   agent (pid 1) --fork--> supervisor (subreaper, one per command) --vfork--> command
 *         |       --fork--> file-op child (switched to the caller's user)
 *
 * The supervisor is usually forked ahead of time, while the agent is idle (a "spare",
 * handed the request and the command's fds when it comes: see spare_start()), and it
 * reports the command's status before it exits (supervisor_exit()): neither a fork nor
 * a process teardown is on a command's path.
 *
 * The edge passes a *listening* unix socket as fd $DSEC_AGENT_FD (default 3). Each
 * connection carries one operation; the wire protocol is described in
 * src/dsec/sessions/protocol.py (frame = u8 type, u32 little-endian length, payload).
 *
 * Hostile-root hardening: the agent is not dumpable (no ptrace, no /proc/1/fd from inside),
 * every fd it owns is O_CLOEXEC, and forked helpers close every fd they do not need, so no
 * command ever inherits the listening socket or another client's connection. As pid 1 it
 * ignores every signal sent from inside the sandbox and reports each one to the edge
 * (see "signals sent to pid 1" below): only the host ends a sandbox.
 *
 * Second mode, host side: `dsec-init crun-wrap ...` wraps every OCI runtime call (fd 3
 * placement, crun 1.8.1 on hybrid cgroup hosts; see crun_wrap()).
 *
 * Third mode, host side: `dsec-init spawner SOCKET` is the per-host process that starts
 * every runtime call and outlives the platform, so container inits always have a parent
 * that reaps them (see spawner_main()).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <malloc.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/keyctl.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define FRAME_HDR 5u
#define MAX_FRAME (16u << 20)         /* largest frame payload we accept */
#define CHUNK 65536u                  /* largest data frame we send */
#define OUT_HIGH (256u * 1024u)       /* stop reading a command's pipes above this backlog */
#define STDIN_HIGH (256u * 1024u)     /* stop reading a client above this stdin backlog */
#define EOF_GRACE_NS (20LL * 1000000LL) /* wait this long for pipe EOF after the main exit */
#define LINGER_NS (5LL * 1000000000LL)  /* wait this long for a client to close after a reply */
#define KILL_PATIENCE_NS (2LL * 1000000000LL)
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_GROUPS 256

#define EXEC_FLAG_STDIN 1u
#define EXEC_FLAG_PTY 2u /* a terminal instead of pipes; u32 rows, u32 cols follow the env */
#define EXEC_FLAG_KEEP 4u /* the agent owns it: str key, str meta, u32 ring bytes follow */
#define KEEP_KEY_MAX 64u
#define KEEP_META_MAX 4096u
#define KEEP_RING_MAX (4u << 20)      /* largest output ring of one kept command */
#define KEEP_RING_TOTAL (8u << 20)    /* shared by all kept commands: each gets its share, */
#define KEEP_RING_MIN (64u << 10)     /* but at least this (so at most 16 MiB in all) */
#define KEEP_MAX 256                  /* kept commands per sandbox, running or finished */
#define KEEP_DONE_MAX 64              /* finished kept commands whose status is still held */
#define KEEP_DONE_TTL_NS (3600LL * 1000000000LL) /* and for at most this long */
#define EXIT_FLAG_TIMED_OUT 1u
#define EXIT_FLAG_TRUNCATED 2u
#define WRITE_FLAG_PARENTS 1u

/* 'O' file-system operations (sub-operation codes and flags) */
#define FS_STAT 1u
#define FS_LIST 2u
#define FS_MKDIR 3u
#define FS_REMOVE 4u
#define FS_MOVE 5u
#define FS_CHMOD 6u
#define FS_SYMLINK 7u
#define FS_FLAG_PARENTS 1u   /* mkdir -p */
#define FS_FLAG_RECURSIVE 2u /* list, remove */
#define FS_FLAG_FOLLOW 4u    /* stat: report what a final symlink points to */
#define LIST_MAX_DEPTH 128

/* ------------------------------------------------------------------------------------ */
/* small helpers                                                                        */

static int64_t now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void put_u32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static void put_u64(unsigned char *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_u32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const unsigned char *p)
{
	return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

static void set_cloexec(int fd)
{
	int fl = fcntl(fd, F_GETFD);
	if (fl >= 0)
		fcntl(fd, F_SETFD, fl | FD_CLOEXEC);
}

static void set_nonblock(int fd, int on)
{
	int fl = fcntl(fd, F_GETFL);
	if (fl >= 0)
		fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

static void close_fd(int *fd)
{
	if (*fd >= 0) {
		close(*fd);
		*fd = -1;
	}
}

/* Close every fd >= low (close_range, with a loop for kernels older than 5.9). */
static void close_from(int low)
{
	if (close_range((unsigned)low, ~0U, 0) == 0)
		return;
	for (int fd = low; fd < 65536; fd++)
		close(fd);
}

/* Move fds[0..n) to base..base+n-1 and close everything from base+n up (for children). */
static void move_fds(const int *fds, int n, int base)
{
	int tmp[8];
	for (int i = 0; i < n; i++) {
		tmp[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 64);
		if (tmp[i] < 0)
			_exit(127);
	}
	for (int i = 0; i < n; i++)
		if (dup2(tmp[i], base + i) < 0)
			_exit(127);
	close_from(base + n);
}

static int status_code(int st)
{
	if (WIFEXITED(st))
		return WEXITSTATUS(st);
	if (WIFSIGNALED(st))
		return 128 + WTERMSIG(st);
	return 255;
}

static void warnx(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	dprintf(2, "dsec-init: %s\n", msg);
}

/* What a forked helper (supervisor, file operation) runs with: the mask pid 1 had
 * before it blocked everything (see "signals sent to pid 1") (SIGCHLD for the supervisor's signalfd; TERM, INT, HUP). */
static void child_signal_mask(void)
{
	sigset_t set;
	sigemptyset(&set);
	sigaddset(&set, SIGCHLD);
	sigaddset(&set, SIGTERM);
	sigaddset(&set, SIGINT);
	sigaddset(&set, SIGHUP);
	sigprocmask(SIG_SETMASK, &set, NULL);
}

/* Growable byte buffer: data lives at p[off, off+len). */
struct buf {
	unsigned char *p;
	size_t off, len, cap;
};

static int buf_add(struct buf *b, const void *d, size_t n)
{
	if (b->off + b->len + n > b->cap) {
		if (b->off) {
			memmove(b->p, b->p + b->off, b->len);
			b->off = 0;
		}
		if (b->len + n > b->cap) {
			size_t nc = b->cap ? b->cap : 4096;
			while (nc < b->len + n)
				nc *= 2;
			unsigned char *np = realloc(b->p, nc);
			if (!np)
				return -1;
			b->p = np;
			b->cap = nc;
		}
	}
	if (n)
		memcpy(b->p + b->off + b->len, d, n);
	b->len += n;
	return 0;
}

static void buf_drop(struct buf *b, size_t n)
{
	b->off += n;
	b->len -= n;
	if (!b->len)
		b->off = 0;
}

static void buf_free(struct buf *b)
{
	free(b->p);
	memset(b, 0, sizeof *b);
}

/* Bounds-checked reader over a frame payload. */
struct rd {
	const unsigned char *p;
	size_t n;
	int bad;
};

static uint32_t rd_u32(struct rd *r)
{
	if (r->n < 4) {
		r->bad = 1;
		return 0;
	}
	uint32_t v = get_u32(r->p);
	r->p += 4;
	r->n -= 4;
	return v;
}

static uint64_t rd_u64(struct rd *r)
{
	if (r->n < 8) {
		r->bad = 1;
		return 0;
	}
	uint64_t v = get_u64(r->p);
	r->p += 8;
	r->n -= 8;
	return v;
}

/* Copy a length-prefixed string into *arena as a C string; NUL bytes inside are refused. */
static char *rd_str(struct rd *r, char **arena)
{
	uint32_t l = rd_u32(r);
	if (r->bad || l > r->n) {
		r->bad = 1;
		return NULL;
	}
	if (memchr(r->p, 0, l)) {
		r->bad = 2;
		return NULL;
	}
	char *s = *arena;
	memcpy(s, r->p, l);
	s[l] = 0;
	*arena += l + 1;
	r->p += l;
	r->n -= l;
	return s;
}

/* ------------------------------------------------------------------------------------ */
/* users: parsed from the sandbox's own /etc/passwd and /etc/group (no NSS in a static   */
/* binary, and the image's files are the only truth inside the sandbox)                  */

struct user_info {
	uid_t uid;
	gid_t gid;
	int has_name;
	char name[256];
	char home[1024];
	int ngroups;
	gid_t groups[MAX_GROUPS];
};

static char *slurp(const char *path, size_t max)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return NULL;
	size_t cap = 4096, n = 0;
	char *b = malloc(cap + 1);
	while (b) {
		if (n == cap) {
			if (cap >= max)
				break;
			char *nb = realloc(b, cap * 2 + 1);
			if (!nb) {
				free(b);
				b = NULL;
				break;
			}
			b = nb;
			cap *= 2;
		}
		ssize_t r = read(fd, b + n, cap - n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		n += (size_t)r;
	}
	close(fd);
	if (b)
		b[n] = 0;
	return b;
}

static int parse_id(const char *s, size_t len, unsigned long *out)
{
	unsigned long v = 0;
	if (!len)
		return -1;
	for (size_t i = 0; i < len; i++) {
		if (s[i] < '0' || s[i] > '9')
			return -1;
		v = v * 10 + (unsigned long)(s[i] - '0');
		if (v > 0xfffffffeUL)
			return -1;
	}
	*out = v;
	return 0;
}

/* Split a line at ':' into at most max fields; returns the number of fields. */
static int split_fields(char *line, char **f, int max)
{
	int n = 0;
	while (n < max) {
		f[n++] = line;
		char *c = strchr(line, ':');
		if (!c)
			break;
		*c = 0;
		line = c + 1;
	}
	return n;
}

/* Find a passwd entry by name (when name != NULL) or by uid. Returns 1 when found. */
static int passwd_find(const char *name, uid_t uid, struct user_info *u)
{
	char *data = slurp("/etc/passwd", 16u << 20);
	if (!data)
		return 0;
	int found = 0;
	char *save = NULL;
	for (char *line = strtok_r(data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *f[7];
		unsigned long pu, pg;
		if (split_fields(line, f, 7) < 6)
			continue;
		if (parse_id(f[2], strlen(f[2]), &pu) || parse_id(f[3], strlen(f[3]), &pg))
			continue;
		if (name ? strcmp(f[0], name) != 0 : (uid_t)pu != uid)
			continue;
		u->uid = (uid_t)pu;
		u->gid = (gid_t)pg;
		u->has_name = 1;
		snprintf(u->name, sizeof u->name, "%s", f[0]);
		snprintf(u->home, sizeof u->home, "%s", f[5][0] ? f[5] : "/");
		found = 1;
		break;
	}
	free(data);
	return found;
}

static void group_add(struct user_info *u, gid_t g)
{
	for (int i = 0; i < u->ngroups; i++)
		if (u->groups[i] == g)
			return;
	if (u->ngroups < MAX_GROUPS)
		u->groups[u->ngroups++] = g;
}

/* Primary group plus every /etc/group entry that lists the user (what initgroups does). */
static void groups_load(struct user_info *u)
{
	u->ngroups = 0;
	group_add(u, u->gid);
	if (!u->has_name)
		return;
	char *data = slurp("/etc/group", 16u << 20);
	if (!data)
		return;
	char *save = NULL;
	for (char *line = strtok_r(data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
		char *f[4];
		unsigned long g;
		if (split_fields(line, f, 4) < 4 || parse_id(f[2], strlen(f[2]), &g))
			continue;
		char *msave = NULL;
		for (char *m = strtok_r(f[3], ",", &msave); m; m = strtok_r(NULL, ",", &msave))
			if (strcmp(m, u->name) == 0)
				group_add(u, (gid_t)g);
	}
	free(data);
}

/* Resolve "root", a passwd name, or "uid[:gid]". Returns 0 or an errno (message in err). */
static int resolve_user(const char *spec, struct user_info *u, char *err, size_t errlen)
{
	memset(u, 0, sizeof *u);
	if (!*spec) {
		snprintf(err, errlen, "empty user name");
		return EINVAL;
	}
	const char *colon = strchr(spec, ':');
	if (spec[0] >= '0' && spec[0] <= '9') {
		unsigned long uid, gid;
		size_t ulen = colon ? (size_t)(colon - spec) : strlen(spec);
		if (parse_id(spec, ulen, &uid) || (colon && parse_id(colon + 1, strlen(colon + 1), &gid))) {
			snprintf(err, errlen, "invalid user '%s': expected a name or uid[:gid]", spec);
			return EINVAL;
		}
		int found = passwd_find(NULL, (uid_t)uid, u);
		u->uid = (uid_t)uid;
		if (!found) {
			u->gid = (gid_t)uid;
			snprintf(u->home, sizeof u->home, "/");
		}
		if (colon) {
			u->gid = (gid_t)gid;
			u->ngroups = 0;
			group_add(u, u->gid);
		} else {
			groups_load(u);
		}
		return 0;
	}
	if (colon) {
		snprintf(err, errlen, "invalid user '%s': expected a name or uid[:gid]", spec);
		return EINVAL;
	}
	if (!passwd_find(spec, 0, u)) {
		if (strcmp(spec, "root") != 0) {
			snprintf(err, errlen, "unknown user '%s': not in the sandbox's /etc/passwd", spec);
			return EINVAL;
		}
		u->uid = 0;
		u->gid = 0;
		u->has_name = 1;
		snprintf(u->name, sizeof u->name, "root");
		snprintf(u->home, sizeof u->home, "/root");
	}
	groups_load(u);
	return 0;
}

static int switch_user(const struct user_info *u)
{
	if (geteuid() != 0 && u->uid == geteuid() && u->gid == getegid())
		return 0; /* unprivileged agent (tests, development): nothing to switch */
	if (setgroups((size_t)u->ngroups, u->groups) < 0)
		return -1;
	if (setresgid(u->gid, u->gid, u->gid) < 0)
		return -1;
	if (setresuid(u->uid, u->uid, u->uid) < 0)
		return -1;
	return 0;
}

/* ------------------------------------------------------------------------------------ */
/* process trees: found through /proc (ppid chains), because setsid and double forks    */
/* escape process groups but never escape a subreaper                                   */

struct pent {
	pid_t pid, ppid;
	char state;
};

/* Send sig to every descendant of root. Returns how many descendants exist (zombies
 * included, since they still have to be reaped), or -1 when /proc is unusable. */
static int signal_descendants(pid_t root, int sig)
{
	DIR *d = opendir("/proc");
	if (!d)
		return -1;
	size_t n = 0, cap = 0;
	struct pent *v = NULL;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] < '1' || e->d_name[0] > '9')
			continue;
		char path[300], st[512];
		snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			continue;
		ssize_t k = read(fd, st, sizeof st - 1);
		close(fd);
		if (k <= 0)
			continue;
		st[k] = 0;
		char *rp = strrchr(st, ')');
		char state;
		int pid = atoi(st), ppid;
		if (!rp || sscanf(rp + 1, " %c %d", &state, &ppid) != 2)
			continue;
		if (n == cap) {
			size_t nc = cap ? cap * 2 : 256;
			struct pent *nv = realloc(v, nc * sizeof *v);
			if (!nv)
				break;
			v = nv;
			cap = nc;
		}
		v[n].pid = pid;
		v[n].ppid = ppid;
		v[n].state = state;
		n++;
	}
	closedir(d);
	char *in = calloc(n ? n : 1, 1);
	if (!in) {
		free(v);
		return -1;
	}
	int changed = 1;
	while (changed) {
		changed = 0;
		for (size_t i = 0; i < n; i++) {
			if (in[i])
				continue;
			int hit = v[i].ppid == root;
			for (size_t j = 0; !hit && j < n; j++)
				hit = in[j] && v[j].pid == v[i].ppid;
			if (hit) {
				in[i] = 1;
				changed = 1;
			}
		}
	}
	int count = 0;
	for (size_t i = 0; i < n; i++) {
		if (!in[i])
			continue;
		count++;
		if (v[i].state != 'Z' && v[i].state != 'X')
			kill(v[i].pid, sig);
	}
	free(in);
	free(v);
	return count;
}

/* ------------------------------------------------------------------------------------ */
/* the command side: supervisor and command processes                                   */

struct exec_req {
	char *user;
	uint32_t flags, timeout_ms;
	uint64_t max_output;
	char *cwd;
	uint32_t argc, envc;
	uint32_t rows, cols; /* terminal size (EXEC_FLAG_PTY) */
	char *key, *meta;    /* EXEC_FLAG_KEEP: the edge's id and opaque description */
	uint32_t ring;       /* EXEC_FLAG_KEEP: output ring size in bytes */
	char **argv; /* argc + 1 */
	char **envp; /* envc + 5: room for HOME, USER, LOGNAME, PATH and NULL */
	char *arena;
};

static void free_req(struct exec_req *r)
{
	free(r->argv);
	free(r->envp);
	free(r->arena);
	memset(r, 0, sizeof *r);
}

static int parse_exec(const unsigned char *p, uint32_t n, struct exec_req *r, char *err, size_t errlen)
{
	memset(r, 0, sizeof *r);
	struct rd rd = {p, n, 0};
	char *arena = malloc((size_t)n + 1);
	r->arena = arena;
	if (!arena) {
		snprintf(err, errlen, "out of memory");
		return ENOMEM;
	}
	r->user = rd_str(&rd, &arena);
	r->flags = rd_u32(&rd);
	r->timeout_ms = rd_u32(&rd);
	r->max_output = rd_u64(&rd);
	r->cwd = rd_str(&rd, &arena);
	r->argc = rd_u32(&rd);
	if (!rd.bad && r->argc > rd.n / 4)
		rd.bad = 1;
	if (!rd.bad) {
		r->argv = calloc((size_t)r->argc + 1, sizeof(char *));
		for (uint32_t i = 0; r->argv && i < r->argc && !rd.bad; i++)
			r->argv[i] = rd_str(&rd, &arena);
	}
	r->envc = rd_u32(&rd);
	if (!rd.bad && r->envc > rd.n / 4)
		rd.bad = 1;
	if (!rd.bad) {
		r->envp = calloc((size_t)r->envc + 5, sizeof(char *));
		for (uint32_t i = 0; r->envp && i < r->envc && !rd.bad; i++) {
			r->envp[i] = rd_str(&rd, &arena);
			if (r->envp[i] && !strchr(r->envp[i], '=')) {
				snprintf(err, errlen, "environment entry '%.100s' has no '='", r->envp[i]);
				free_req(r);
				return EINVAL;
			}
		}
	}
	if (!rd.bad && (r->flags & EXEC_FLAG_PTY)) {
		r->rows = rd_u32(&rd);
		r->cols = rd_u32(&rd);
	}
	if (!rd.bad && (r->flags & EXEC_FLAG_KEEP)) {
		r->key = rd_str(&rd, &arena);
		r->meta = rd_str(&rd, &arena);
		r->ring = rd_u32(&rd);
		if (!rd.bad && (!r->key[0] || strlen(r->key) > KEEP_KEY_MAX || strlen(r->meta) > KEEP_META_MAX)) {
			snprintf(err, errlen, "a kept command needs a key of 1-%u bytes and meta of at most %u",
				 KEEP_KEY_MAX, KEEP_META_MAX);
			free_req(r);
			return EINVAL;
		}
	}
	if (rd.bad == 2) {
		snprintf(err, errlen, "strings must not contain NUL bytes");
		free_req(r);
		return EINVAL;
	}
	if (rd.bad || !r->argv || !r->envp) {
		snprintf(err, errlen, rd.bad ? "malformed exec request" : "out of memory");
		int e = rd.bad ? EINVAL : ENOMEM;
		free_req(r);
		return e;
	}
	if (r->argc == 0) {
		snprintf(err, errlen, "argv must not be empty");
		free_req(r);
		return EINVAL;
	}
	return 0;
}

/* Report a failure before the program started (over the ctl pipe, fd 3) and exit. */
static void __attribute__((noreturn, format(printf, 3, 4))) child_fail(int ctl, int err, const char *fmt, ...)
{
	unsigned char m[1 + 4 + 2 + 1024];
	char msg[1000];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	size_t ml = strlen(msg);
	m[0] = 'f';
	put_u32(m + 1, (uint32_t)err);
	m[5] = (unsigned char)(ml & 0xff);
	m[6] = (unsigned char)(ml >> 8);
	memcpy(m + 7, msg, ml);
	if (write(ctl, m, 7 + ml) < 0) {
		/* nobody to tell */
	}
	_exit(127);
}

static void try_exec(const char *file, char **argv, char **envp)
{
	execve(file, argv, envp);
	if (errno != ENOEXEC)
		return;
	/* a script without #! line: run it with /bin/sh, as execvp does */
	int argc = 0;
	while (argv[argc])
		argc++;
	char **nargv = calloc((size_t)argc + 2, sizeof(char *));
	if (!nargv)
		return;
	nargv[0] = (char *)"/bin/sh";
	nargv[1] = (char *)file;
	for (int i = 1; i < argc; i++)
		nargv[i + 1] = argv[i];
	execve("/bin/sh", nargv, envp);
	free(nargv);
	errno = ENOEXEC;
}

/* Like execvpe, but searching the command's own PATH, not the agent's. */
static void __attribute__((noreturn)) exec_program(char **argv, char **envp, int ctl)
{
	const char *prog = argv[0];
	if (strchr(prog, '/')) {
		try_exec(prog, argv, envp);
		child_fail(ctl, errno, "cannot execute '%s': %s", prog, strerror(errno));
	}
	const char *path = DEFAULT_PATH;
	for (char **e = envp; *e; e++)
		if (strncmp(*e, "PATH=", 5) == 0)
			path = *e + 5;
	int saw_eacces = 0;
	size_t plen = strlen(prog);
	char buf[PATH_MAX];
	for (const char *p = path;; p++) {
		const char *end = strchrnul(p, ':');
		size_t dl = (size_t)(end - p);
		if (plen && dl + plen + 2 <= sizeof buf) {
			if (dl) {
				memcpy(buf, p, dl);
				buf[dl] = '/';
				memcpy(buf + dl + 1, prog, plen + 1);
			} else {
				memcpy(buf, prog, plen + 1);
			}
			try_exec(buf, argv, envp);
			if (errno == EACCES)
				saw_eacces = 1;
			else if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP && errno != ENAMETOOLONG)
				child_fail(ctl, errno, "cannot execute '%s': %s", buf, strerror(errno));
		}
		if (!*end)
			break;
		p = end;
	}
	if (saw_eacces)
		child_fail(ctl, EACCES, "cannot execute '%s': permission denied", prog);
	child_fail(ctl, ENOENT, "program '%s' not found (PATH=%.400s)", prog, path);
}

static int env_has(char **envp, const char *key)
{
	size_t kl = strlen(key);
	for (char **e = envp; *e; e++)
		if (strncmp(*e, key, kl) == 0 && (*e)[kl] == '=')
			return 1;
	return 0;
}

static void env_add(char **envp, const char *key, const char *val)
{
	if (env_has(envp, key))
		return;
	char **e = envp;
	while (*e)
		e++;
	size_t n = strlen(key) + strlen(val) + 2;
	char *s = malloc(n);
	if (!s)
		return;
	snprintf(s, n, "%s=%s", key, val);
	*e = s;
}

static struct rlimit g_nofile_orig;

/* The only signals whose disposition the agent changes (agent_main): a command resets
 * these, and agent_main resets all others to the default once, whatever it inherited. */
static const int AGENT_SIGNALS[] = {SIGTERM, SIGINT, SIGHUP, SIGPIPE};

/* The command process: own session, caller's user, cwd and environment, then exec. */
static void __attribute__((noreturn)) command_main(struct exec_req *r, const struct user_info *u)
{
	/* The agent reset every disposition at its start (agent_main), so only the ones it
	 * set itself differ from the default: 4 system calls here, not 64 (each also passes
	 * the seccomp filter), on every command's path. */
	struct sigaction dfl;
	memset(&dfl, 0, sizeof dfl);
	dfl.sa_handler = SIG_DFL;
	for (size_t k = 0; k < sizeof AGENT_SIGNALS / sizeof AGENT_SIGNALS[0]; k++)
		sigaction(AGENT_SIGNALS[k], &dfl, NULL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	setsid();
	if ((r->flags & EXEC_FLAG_PTY) && ioctl(0, TIOCSCTTY, 0) < 0)
		child_fail(3, errno, "cannot acquire the terminal: %s", strerror(errno));
	if (switch_user(u) < 0)
		child_fail(3, errno, "cannot switch to user '%s' (uid %u, gid %u): %s", r->user,
			   (unsigned)u->uid, (unsigned)u->gid, strerror(errno));
	if (r->cwd[0]) {
		if (chdir(r->cwd) < 0)
			child_fail(3, errno, "cannot use '%s' as working directory: %s", r->cwd, strerror(errno));
	} else if (chdir(u->home) < 0 && chdir("/") < 0) {
		child_fail(3, errno, "cannot change to '/': %s", strerror(errno));
	}
	exec_program(r->argv, r->envp, 3);
}

struct command_start {
	struct exec_req *r;
	const struct user_info *u;
};

/* The stack command_main runs on until its execve (see supervisor_main): the PATH
 * search and a failure's message need a few KiB; 64 KiB leaves room for libc. */
static unsigned char g_command_stack[64 * 1024] __attribute__((aligned(16)));

static int command_entry(void *arg)
{
	struct command_start *start = arg;
	command_main(start->r, start->u);
}

/* The supervisor's last act: its command's status to the agent ('x' on the ctl pipe,
 * fd 3), then exit. The agent reports the command done from the 'x' without waiting
 * for the kernel to tear this process down and signal it (~0.1 ms of every command);
 * the reap that follows finds the command already finished. */
static void __attribute__((noreturn)) supervisor_exit(int code)
{
	unsigned char m[5] = {'x'};
	put_u32(m + 1, (uint32_t)code);
	if (write(3, m, 5) < 0) {
		/* the agent is gone or stopped listening: the reap reports the same status */
	}
	_exit(code);
}

/* Wait for the command's main process; on request, signal or kill its whole tree.
 * fd 4 is the agent's control pipe: 'S'+u32 signal delivers a signal, EOF means kill. */
static void __attribute__((noreturn)) supervise(pid_t pid, int sfd)
{
	int code = -1, killing = 0;
	int64_t kill_start = 0;
	struct pollfd pf[2] = {{sfd, POLLIN, 0}, {4, POLLIN, 0}};
	for (;;) {
		int st;
		pid_t w;
		while ((w = waitpid(-1, &st, WNOHANG)) > 0)
			if (w == pid)
				code = status_code(st);
		if (code >= 0 && !killing)
			supervisor_exit(code);
		if (killing) {
			int left = signal_descendants(getpid(), SIGKILL);
			if (left < 0) /* no /proc: the session is all we can reach */
				kill(-pid, SIGKILL);
			while ((w = waitpid(-1, &st, WNOHANG)) > 0)
				if (w == pid)
					code = status_code(st);
			if ((left == 0 || (left < 0 && code >= 0)) ||
			    now_ns() - kill_start > KILL_PATIENCE_NS)
				supervisor_exit(code >= 0 ? code : 128 + SIGKILL);
		}
		if (poll(pf, 2, killing ? 2 : -1) < 0 && errno != EINTR)
			supervisor_exit(code >= 0 ? code : 255);
		if (pf[0].revents) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof si) > 0) {
			}
		}
		if (pf[1].fd >= 0 && pf[1].revents) {
			unsigned char m[5 * 16];
			ssize_t k = read(4, m, sizeof m);
			if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN)) {
				killing = 1;
				kill_start = now_ns();
				pf[1].fd = -1;
				close(4);
			}
			for (ssize_t i = 0; i + 5 <= k; i += 5) {
				if (m[i] != 'S')
					continue;
				int sig = (int)get_u32(m + i + 1);
				if (sig == SIGKILL && !killing) {
					killing = 1;
					kill_start = now_ns();
				} else if (signal_descendants(getpid(), sig) < 0) {
					kill(-pid, sig);
				}
			}
		}
	}
}

/* Forked by the agent for each command. fds: stdin_r, stdout_w, stderr_w, ctl_w, sup_r. */
static void __attribute__((noreturn)) supervisor_main(struct exec_req *r, const int fds[5])
{
	child_signal_mask();
	move_fds(fds, 5, 0); /* now 0,1,2 = command stdio, 3 = ctl, 4 = agent's control pipe */
	set_cloexec(3);
	set_cloexec(4);
	setrlimit(RLIMIT_NOFILE, &g_nofile_orig);
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	struct user_info u;
	char err[512];
	int e = resolve_user(r->user, &u, err, sizeof err);
	if (e)
		child_fail(3, e, "%s", err);
	if ((r->flags & EXEC_FLAG_PTY) && fchown(0, u.uid, (gid_t)-1) < 0) {
		/* the terminal stays root's: programs still work, `tty` ownership checks may not */
	}
	env_add(r->envp, "PATH", DEFAULT_PATH);
	env_add(r->envp, "HOME", u.home);
	if (u.has_name) {
		env_add(r->envp, "USER", u.name);
		env_add(r->envp, "LOGNAME", u.name);
	}
	sigset_t chld;
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK); /* SIGCHLD is already blocked */
	if (sfd < 0)
		child_fail(3, errno, "signalfd: %s", strerror(errno));
	struct command_start start = {r, &u};
	/* CLONE_VM|CLONE_VFORK, as posix_spawn does: the command runs on its own stack in
	 * our memory until its execve, and we wait for that. No copy of our page tables,
	 * no copy-on-write faults (each a TLB flush across CPUs, costly in a VM) for a
	 * memory image the execve throws away: the part of a command's start that is ours
	 * to cut. The child only makes system calls and writes its own stack (child_fail's
	 * message, the PATH search); our dispositions, mask and fds are its own copies.
	 * The price: until the execve returns we cannot act on the agent's control pipe, so
	 * a kill that arrives while the kernel is still loading the program (a layer being
	 * fetched) takes effect right after it; stopping the sandbox kills it at once. */
	pid_t pid = clone(command_entry, g_command_stack + sizeof g_command_stack,
			  CLONE_VM | CLONE_VFORK | SIGCHLD, &start);
	if (pid < 0)
		child_fail(3, errno, "cannot start a process: %s", strerror(errno));
	unsigned char m[5] = {'p'};
	put_u32(m + 1, (uint32_t)pid);
	if (write(3, m, 5) < 0) {
		/* the agent will notice the exit anyway */
	}
	/* fd 3 stays open for the command's status (supervisor_exit) */
	close(0); /* only the command holds its pipes now, so EOF means it is done */
	close(1);
	close(2);
	supervise(pid, sfd);
}

/* The spare supervisor: forked ahead of time, while the agent is idle, so that starting
 * a command costs handing it the request and five fds, not a fork of the agent (its
 * page tables copied, copy-on-write faults on both sides) on the command's path. It is
 * forked only once the sandbox has run a command and no foreground command is running
 * (it must not compete with one for the CPU), and it exits after 30 s unused (by default:
 * DSEC_AGENT_SPARE_IDLE_MS; 0 turns spares off):
 * an idle sandbox holds no extra process. A request larger than SPARE_REQ_MAX, or any
 * failure to hand it over, falls back to forking the supervisor as before. */
#define SPARE_REQ_MAX (64u * 1024)

static int64_t g_spare_idle_ns = 30LL * 1000000000LL; /* DSEC_AGENT_SPARE_IDLE_MS */

static pid_t g_spare;          /* the spare's pid; 0: none */
static int g_spare_fd = -1;    /* our end of its socket (SOCK_SEQPACKET) */
static int64_t g_spare_until;  /* when an unused spare is let go */
static int g_spare_wanted;     /* a command started since the last spare was forked */

/* In the spare: fd 5 is its socket, all others closed. One message: the exec request's
 * bytes (parsed again here, as the agent parsed them) with the command's five fds. EOF
 * (the agent let it go) ends it. */
static void __attribute__((noreturn)) spare_main(void)
{
	unsigned char *buf = malloc(SPARE_REQ_MAX);
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(5 * sizeof(int))];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = {buf, SPARE_REQ_MAX};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
	ssize_t n;
	do
		n = buf ? recvmsg(5, &mh, MSG_CMSG_CLOEXEC) : -1;
	while (n < 0 && errno == EINTR);
	struct cmsghdr *h = n > 0 ? CMSG_FIRSTHDR(&mh) : NULL;
	if (!h || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || h->cmsg_level != SOL_SOCKET ||
	    h->cmsg_type != SCM_RIGHTS || h->cmsg_len != CMSG_LEN(5 * sizeof(int)))
		_exit(0); /* let go, or not a request from the agent: the agent sees a dead supervisor */
	int fds[5];
	memcpy(fds, CMSG_DATA(h), sizeof fds);
	prctl(PR_SET_NAME, "dsec-init"); /* a supervisor now, named as a forked one is */
	struct exec_req r;
	char err[256];
	int e = parse_exec(buf, (uint32_t)n, &r, err, sizeof err);
	if (e)
		child_fail(fds[3], e, "%s", err);
	supervisor_main(&r, fds);
}

static void spare_start(void)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) < 0)
		return;
	pid_t pid = fork();
	if (pid == 0) {
		child_signal_mask();
		prctl(PR_SET_NAME, "dsec-spare"); /* what it is, in ps */
		move_fds(&sv[1], 1, 5); /* closes every fd of ours from 6 up: no connection is held open */
		close_range(0, 4, 0);
		spare_main();
	}
	close(sv[1]);
	if (pid < 0) {
		close(sv[0]);
		return;
	}
	g_spare = pid;
	g_spare_fd = sv[0];
	g_spare_until = now_ns() + g_spare_idle_ns;
}

/* Let the spare go (it exits at EOF; the reap finds no command for it). */
static void spare_drop(void)
{
	close_fd(&g_spare_fd);
	g_spare = 0;
}

/* Hand a command to the spare: its supervisor's pid, or 0 (no spare, or it could not take
 * it: the caller forks one). The spare is used once either way. */
static pid_t spare_take(const unsigned char *p, uint32_t n, const int fds[5])
{
	if (!g_spare || n > SPARE_REQ_MAX)
		return 0;
	pid_t pid = g_spare;
	int s = g_spare_fd;
	g_spare = 0;
	g_spare_fd = -1;
	union {
		struct cmsghdr h;
		char b[CMSG_SPACE(5 * sizeof(int))];
	} u;
	memset(&u, 0, sizeof u);
	struct iovec iov = {(void *)p, n};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof u.b};
	struct cmsghdr *h = CMSG_FIRSTHDR(&mh);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(5 * sizeof(int));
	memcpy(CMSG_DATA(h), fds, 5 * sizeof(int));
	ssize_t k = sendmsg(s, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
	close(s);
	if (k == (ssize_t)n) {
		/* Root inside may have stopped it while it waited: a stopped spare would hold the
		 * next command (someone else's) before it ever started. */
		kill(pid, SIGCONT);
		return pid;
	}
	kill(pid, SIGKILL); /* still our unreaped child: the pid cannot name anyone else */
	return 0;
}

/* ------------------------------------------------------------------------------------ */
/* the agent: connections and commands                                                  */

enum conn_state { CS_HEADER, CS_EXEC, CS_CLOSING, CS_WATCH };

struct cmd;

struct conn {
	struct conn *next;
	int fd;
	enum conn_state state;
	int dead;    /* closed; freed at the end of the loop iteration */
	int wr_shut; /* reply flushed and write side shut: waiting for the client to close */
	int rd_eof;  /* the client shut its write side: nothing more to read */
	int64_t linger_deadline;
	struct buf in, out;
	struct cmd *cmd;
	uint64_t z_serial; /* a kept command's 'Z' is queued here: once flushed, delivered */
};

struct cmd {
	struct cmd *next;
	struct conn *conn; /* NULL once the client is gone (or got its failure) */
	pid_t sup, pid;
	int out_fd, err_fd, in_fd, ctl_fd, sup_fd;
	int pty_fd; /* the terminal's master side (EXEC_FLAG_PTY), for resizing */
	struct buf stdin_buf;
	int stdin_close;
	uint64_t budget;
	int truncated, timed_out, started, failed, sup_exited, dead;
	int exit_code;
	int64_t start_ns, deadline_ns, exit_ns, grace_ns;
	unsigned char ctl[1100];
	size_t ctl_len;
	/* EXEC_FLAG_KEEP ("kept" commands, the edge's background processes): the agent owns
	 * them, not the connection. A lost client does not kill them; their output goes to a
	 * bounded ring of records (wire frames 'O'/'E', numbered from 0) that a new client
	 * replays from any record still held ('A'); a finished one keeps its exit status and
	 * ring until the edge forgets it ('K') or KEEP_DONE_MAX / KEEP_DONE_TTL_NS pass. */
	int keep, finished, delivered; /* delivered: its 'Z' reached a client in full */
	uint64_t serial;
	char *key, *meta;
	struct buf ring;
	size_t ring_cap;
	uint64_t first_seq, next_seq; /* record numbers: first held, next to come */
	int64_t wall_ns, done_ns;     /* start (CLOCK_REALTIME), end (monotonic) */
};

static int g_lfd = -1, g_sfd = -1, g_pid1;
static pid_t g_agent_pid;
static struct conn *g_conns;
static struct cmd *g_cmds;
static int64_t g_accept_pause_until;
static unsigned char g_iobuf[FRAME_HDR + CHUNK];

static void __attribute__((noreturn)) shutdown_all(void);
static int conn_frame(struct conn *c, int type, const void *a, size_t an, const void *b, size_t bn);

/* ------------------------------------------------------------------------------------ */
/* signals sent to pid 1                                                                */
/* Only the host ends a sandbox: with SIGKILL (the edge empties the cgroup, or crun      */
/* delete --force; the kernel always delivers SIGKILL to a namespace's init from an     */
/* ancestor namespace), with 'Q' on the agent socket (which exists only on the host),   */
/* or with SIGTERM/SIGINT from outside (an operator's `crun kill`). Every catchable     */
/* signal is blocked and read from the signalfd, so whatever path one took (kill,       */
/* tgkill, sigqueue, pidfd_send_signal, a process group, F_SETOWN + F_SETSIG, ...) it   */
/* arrives as data, never as an action, and is reported to the edge. SIGKILL and        */
/* SIGSTOP cannot be blocked; the kernel drops them for a namespace's init unless they  */
/* come from an ancestor namespace (the seccomp profile records kill(1, ...) attempts). */
/*                                                                                      */
/* Who sent it: for SI_USER the kernel fills in the sender's pid as seen from our pid   */
/* namespace, and 0 for a sender in an ancestor namespace. SI_USER cannot be forged:    */
/* rt_sigqueueinfo and pidfd_send_signal refuse a non-negative si_code unless a process */
/* signals itself, while their negative codes (SI_QUEUE, ...) carry a pid of the        */
/* sender's choosing. So "from the host" is SI_USER with pid 0, and nothing else is.    */
/* The edge opens a watcher connection ('N'); each ignored signal becomes a 'G' frame: */
/*   u32 signo, i32 si_code, u32 pid, u32 uid, u32 not_itemised_before, char comm[16]   */
/* (signo 0: only a count of signals that did not fit the ring). Bounded: a flood is    */
/* counted, never stored, and never keeps the loop from its other work.                 */
/*                                                                                      */
/* The watcher is opened on demand (an idle sandbox costs the edge no fd for it): with  */
/* a note and no watcher, pid 1 rings a doorbell, a system call the seccomp profile     */
/* hands to the edge's listener: reboot(0, 0, DOORBELL, NULL). Only the listener sees   */
/* it (it answers EPERM; without a listener the call fails, ENOSYS or EPERM; the bad    */
/* magic makes the kernel refuse it before anything else). The edge then connects,      */
/* sends 'N' and shuts its write side: pid 1 hands over every note it holds, sees the   */
/* end of input, stops writing notes there and shuts its own side, so the edge reads    */
/* everything up to that end and nothing is lost between the two. Notes that arrive    */
/* later ring again. An edge that keeps the connection open (one restarted without a    */
/* listener, a VM's) gets every note as before and no doorbell rings.                   */

#define NOTE_RING 32
#define NOTE_LEN 36u
#define NOTE_OUT_HIGH 4096u /* leave notes in the ring while the watcher lags */
#define SIG_READS 256       /* signals read per wake-up */

struct sig_note {
	uint32_t signo, pid, uid, before;
	int32_t code;
	char comm[16];
};

static struct sig_note g_notes[NOTE_RING];
static unsigned g_note_head, g_note_len;
static uint32_t g_notes_lost; /* not itemised since the last note that was stored */
static struct conn *g_watcher;
static int64_t g_rang_ns; /* when the doorbell last rang with no watcher since (0: not) */

#define DOORBELL 0x44534543u          /* 'DSEC': reboot's cmd argument */
#define DOORBELL_AGAIN_NS 1000000000LL /* ring again if nobody came within this */

static void ring_doorbell(void)
{
	int64_t now = now_ns();
	if (g_rang_ns && now - g_rang_ns < DOORBELL_AGAIN_NS)
		return;
	g_rang_ns = now;
	syscall(SYS_reboot, 0, 0, DOORBELL, NULL); /* fails by design (see above) */
}

/* The kernel's 64-bit signal set with every signal: glibc's sigfillset and sigprocmask
 * leave out its two internal real-time signals, which would then reach us unseen. */
static const uint64_t ALL_SIGNALS = ~0ULL;

static void block_all_signals(void)
{
	syscall(SYS_rt_sigprocmask, SIG_BLOCK, &ALL_SIGNALS, NULL, sizeof ALL_SIGNALS);
}

static void read_comm(pid_t pid, char comm[16])
{
	char path[40];
	snprintf(path, sizeof path, "/proc/%d/comm", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return;
	ssize_t n = read(fd, comm, 15);
	close(fd);
	if (n > 0 && comm[n - 1] == '\n')
		n--;
	comm[n > 0 ? n : 0] = 0;
}

static void flush_notes(void)
{
	struct conn *w = g_watcher;
	if (!w || w->dead)
		return;
	unsigned char m[NOTE_LEN];
	while (w->out.len < NOTE_OUT_HIGH && (g_note_len || g_notes_lost)) {
		struct sig_note z = {0}, *n = &z;
		if (g_note_len) {
			n = &g_notes[g_note_head];
			g_note_head = (g_note_head + 1) % NOTE_RING;
			g_note_len--;
		} else {
			z.before = g_notes_lost; /* signo 0: a count only */
			g_notes_lost = 0;
		}
		put_u32(m, n->signo);
		put_u32(m + 4, (uint32_t)n->code);
		put_u32(m + 8, n->pid);
		put_u32(m + 12, n->uid);
		put_u32(m + 16, n->before);
		memcpy(m + 20, n->comm, 16);
		if (conn_frame(w, 'G', m, sizeof m, NULL, 0) < 0)
			return;
	}
}

static void note_signal(const struct signalfd_siginfo *si)
{
	if (g_note_len == NOTE_RING) {
		g_notes_lost++;
		return;
	}
	struct sig_note *n = &g_notes[(g_note_head + g_note_len++) % NOTE_RING];
	memset(n, 0, sizeof *n);
	n->signo = si->ssi_signo;
	n->code = si->ssi_code;
	n->pid = si->ssi_pid;
	n->uid = si->ssi_uid;
	n->before = g_notes_lost;
	g_notes_lost = 0;
	/* The kernel filled in the pid (SI_USER, SI_TKILL): its name is worth a look. A
	 * sender-chosen pid (SI_QUEUE, ...) would only name an innocent process. */
	if (n->pid > 1 && (n->code == SI_USER || n->code == SI_TKILL))
		read_comm((pid_t)n->pid, n->comm);
	flush_notes();
	if (g_pid1 && (!g_watcher || g_watcher->dead))
		ring_doorbell();
}

static void watch_signals(struct conn *c)
{
	if (g_watcher && g_watcher != c && !g_watcher->dead) { /* a restarted edge: the newest */
		close_fd(&g_watcher->fd);
		g_watcher->dead = 1;
	}
	g_watcher = c;
	g_rang_ns = 0;
	c->state = CS_WATCH;
	flush_notes();
}

/* The edge shut its side of a watcher connection: it has what was sent and reads up to
 * our end; notes from now on stay in the ring (and ring the doorbell). */
static void watch_ended(struct conn *c)
{
	c->rd_eof = 1;
	if (g_watcher == c)
		g_watcher = NULL;
	c->state = CS_CLOSING; /* flush what is queued, then shut our side */
}

static int conn_frame(struct conn *c, int type, const void *a, size_t an, const void *b, size_t bn)
{
	unsigned char h[FRAME_HDR];
	h[0] = (unsigned char)type;
	put_u32(h + 1, (uint32_t)(an + bn));
	if (buf_add(&c->out, h, FRAME_HDR) || buf_add(&c->out, a, an) || buf_add(&c->out, b, bn))
		return -1;
	return 0;
}

static void conn_fail(struct conn *c, int err, const char *msg)
{
	unsigned char e[4];
	put_u32(e, (uint32_t)err);
	conn_frame(c, 'F', e, 4, msg, strlen(msg));
	c->state = CS_CLOSING;
}

/* Ask the supervisor to kill the command's whole tree: closing its pipe is the request,
 * and a supervisor someone stopped (root inside can) is woken to act on it. */
static void cmd_kill(struct cmd *cmd)
{
	close_fd(&cmd->sup_fd);
	if (!cmd->sup_exited && cmd->sup > 0)
		kill(cmd->sup, SIGCONT); /* our unreaped child: the pid names no one else */
}

static void conn_lost(struct conn *c)
{
	if (c->cmd) {
		struct cmd *cmd = c->cmd;
		cmd->conn = NULL;
		c->cmd = NULL;
		if (!cmd->sup_exited && !cmd->keep) /* a kept command waits for a new client */
			cmd_kill(cmd);
	}
	close_fd(&c->fd);
	c->dead = 1;
}

static unsigned g_kept; /* kept commands allocated (running or finished and held) */

/* Append one output record to a kept command's ring, dropping the oldest records first
 * so that the ring never holds more than its size: the smaller of what the edge asked
 * for and this command's share of KEEP_RING_TOTAL (at least KEEP_RING_MIN). */
static size_t keep_cap(const struct cmd *cmd)
{
	size_t cap = cmd->ring_cap, share = KEEP_RING_TOTAL / (g_kept ? g_kept : 1);
	if (share < KEEP_RING_MIN)
		share = KEEP_RING_MIN;
	return cap < share ? cap : share;
}

/* Drop the oldest records until `room` more bytes fit in the ring's size. */
static void keep_trim(struct cmd *cmd, size_t room)
{
	size_t cap = keep_cap(cmd);
	while (cmd->ring.len && cmd->ring.len + room > cap) {
		size_t l = FRAME_HDR + get_u32(cmd->ring.p + cmd->ring.off + 1);
		buf_drop(&cmd->ring, l);
		cmd->first_seq++;
	}
	if (cmd->ring.cap > 2 * cap + 2 * FRAME_HDR + 2 * CHUNK) { /* its share shrank */
		struct buf b = {0};
		if (buf_add(&b, cmd->ring.p + cmd->ring.off, cmd->ring.len) == 0) {
			buf_free(&cmd->ring);
			cmd->ring = b;
		}
	}
}

static void keep_record(struct cmd *cmd, int type, const unsigned char *d, size_t n)
{
	keep_trim(cmd, FRAME_HDR + n);
	unsigned char h[FRAME_HDR];
	h[0] = (unsigned char)type;
	put_u32(h + 1, (uint32_t)n);
	cmd->next_seq++;
	if (buf_add(&cmd->ring, h, FRAME_HDR) || buf_add(&cmd->ring, d, n)) {
		buf_free(&cmd->ring); /* out of memory: lose the history, never the agent */
		cmd->first_seq = cmd->next_seq;
	}
}

static void cmd_emit(struct cmd *cmd, int type, const unsigned char *d, size_t n)
{
	size_t k = 0;
	if ((cmd->conn || cmd->keep) && cmd->budget) {
		k = n < cmd->budget ? n : (size_t)cmd->budget;
		cmd->budget -= k;
		if (cmd->keep)
			keep_record(cmd, type, d, k);
		if (cmd->conn && conn_frame(cmd->conn, type, d, k, NULL, 0) < 0) {
			conn_lost(cmd->conn);
			return;
		}
	}
	if (k < n)
		cmd->truncated = 1;
}

static int cmd_wants_output(const struct cmd *cmd)
{
	return !cmd->conn || !cmd->budget || cmd->conn->out.len < OUT_HIGH;
}

static void cmd_read_output(struct cmd *cmd, int err, size_t limit)
{
	int *fdp = err ? &cmd->err_fd : &cmd->out_fd;
	size_t got = 0;
	while (*fdp >= 0 && got < limit) {
		ssize_t n = read(*fdp, g_iobuf, CHUNK);
		if (n > 0) {
			got += (size_t)n;
			cmd_emit(cmd, err ? 'E' : 'O', g_iobuf, (size_t)n);
			if (!cmd_wants_output(cmd))
				break;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		close_fd(fdp);
	}
}

static void cmd_write_stdin(struct cmd *cmd)
{
	while (cmd->in_fd >= 0 && cmd->stdin_buf.len) {
		ssize_t n = write(cmd->in_fd, cmd->stdin_buf.p + cmd->stdin_buf.off, cmd->stdin_buf.len);
		if (n > 0) {
			buf_drop(&cmd->stdin_buf, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		close_fd(&cmd->in_fd); /* EPIPE: the command does not read stdin any more */
	}
	if (cmd->in_fd >= 0 && cmd->stdin_close)
		close_fd(&cmd->in_fd);
	if (cmd->in_fd < 0 || !cmd->stdin_buf.len)
		buf_free(&cmd->stdin_buf);
}

/* The command could not start ('f' from the supervisor or its child): tell the client. */
static void cmd_start_failed(struct cmd *cmd, int err, const char *msg, size_t msglen)
{
	cmd->failed = 1;
	if (cmd->conn) {
		char m[1024];
		snprintf(m, sizeof m, "%.*s", (int)msglen, msg);
		conn_fail(cmd->conn, err, m);
		cmd->conn->cmd = NULL;
		cmd->conn = NULL;
	}
}

/* The command is running (its execve returned): 'P' to the client, start reading. */
static void cmd_started(struct cmd *cmd, pid_t pid)
{
	cmd->started = 1;
	cmd->pid = pid ? pid : cmd->sup;
	if (cmd->conn) {
		unsigned char p[4];
		put_u32(p, (uint32_t)cmd->pid);
		if (conn_frame(cmd->conn, 'P', p, 4, NULL, 0) < 0)
			conn_lost(cmd->conn);
	}
	cmd_read_output(cmd, 0, CHUNK);
	cmd_read_output(cmd, 1, CHUNK);
}

/* The supervisor is done and its command's status is ``code`` (from its 'x' message or
 * from reaping it, whichever comes first; the other is then ignored). */
static void cmd_sup_done(struct cmd *cmd, int code)
{
	if (cmd->sup_exited)
		return;
	int64_t now = now_ns();
	cmd->sup_exited = 1;
	cmd->exit_code = code;
	cmd->exit_ns = now;
	cmd->grace_ns = now + EOF_GRACE_NS;
	close_fd(&cmd->sup_fd);
	if (cmd->started) {
		cmd_read_output(cmd, 0, CHUNK);
		cmd_read_output(cmd, 1, CHUNK);
	}
}

/* The ctl pipe's messages, parsed as they arrive, in the order they are written: 'f'
 * (errno, u16 length, message: the command could not start; the child writes it before
 * its execve fails, so before the supervisor's 'p'), 'p' (the command's pid: it runs),
 * 'x' (its exit status: the supervisor is exiting). At EOF without 'p' or 'f' (the
 * supervisor died early) the command counts as started, as the supervisor itself. */
static void cmd_ctl_parse(struct cmd *cmd, int eof)
{
	size_t i = 0;
	while (i < cmd->ctl_len && !cmd->failed) {
		unsigned char t = cmd->ctl[i];
		if (t == 'f') {
			if (i + 7 > cmd->ctl_len)
				break;
			size_t msglen = (size_t)cmd->ctl[i + 5] | (size_t)cmd->ctl[i + 6] << 8;
			if (i + 7 + msglen > cmd->ctl_len) {
				if (!eof && cmd->ctl_len < sizeof cmd->ctl)
					break;
				msglen = cmd->ctl_len - i - 7;
			}
			cmd_start_failed(cmd, (int)get_u32(cmd->ctl + i + 1), (const char *)cmd->ctl + i + 7, msglen);
			i = cmd->ctl_len;
		} else if (t == 'p' || t == 'x') {
			if (i + 5 > cmd->ctl_len)
				break;
			uint32_t v = get_u32(cmd->ctl + i + 1);
			i += 5;
			if (t == 'p' && !cmd->started)
				cmd_started(cmd, (pid_t)v);
			else if (t == 'x' && cmd->started)
				cmd_sup_done(cmd, (int)(v & 0xff));
		} else {
			i = cmd->ctl_len; /* not ours: the reap will tell */
		}
	}
	if (cmd->failed)
		i = cmd->ctl_len;
	memmove(cmd->ctl, cmd->ctl + i, cmd->ctl_len - i);
	cmd->ctl_len -= i;
	if (eof && !cmd->started && !cmd->failed)
		cmd_started(cmd, 0);
}

static void cmd_read_ctl(struct cmd *cmd)
{
	while (cmd->ctl_fd >= 0) {
		size_t room = sizeof cmd->ctl - cmd->ctl_len;
		unsigned char sink[256];
		ssize_t n = room ? read(cmd->ctl_fd, cmd->ctl + cmd->ctl_len, room) : read(cmd->ctl_fd, sink, sizeof sink);
		if (n > 0) {
			if (room) {
				cmd->ctl_len += (size_t)n;
				cmd_ctl_parse(cmd, 0);
			}
			if (cmd->sup_exited || cmd->failed)
				close_fd(&cmd->ctl_fd); /* nothing more to learn from it */
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		close_fd(&cmd->ctl_fd);
		cmd_ctl_parse(cmd, 1);
	}
}

static void on_sup_exit(struct cmd *cmd, int st)
{
	if (cmd->ctl_fd >= 0) {
		cmd_read_ctl(cmd);
		if (cmd->ctl_fd >= 0) { /* someone else holds it: stop waiting */
			close_fd(&cmd->ctl_fd);
			cmd_ctl_parse(cmd, 1);
		}
	}
	cmd_sup_done(cmd, status_code(st));
}

/* Finish a command once its main process is gone and its pipes reached EOF (or the grace
 * period for EOF is over: a background process may hold the pipes forever). */
static void cmd_exit_payload(const struct cmd *cmd, unsigned char z[16])
{
	uint32_t flags = (cmd->timed_out ? EXIT_FLAG_TIMED_OUT : 0) | (cmd->truncated ? EXIT_FLAG_TRUNCATED : 0);
	put_u32(z, (uint32_t)(cmd->timed_out ? 128 + SIGKILL : cmd->exit_code));
	put_u32(z + 4, flags);
	put_u64(z + 8, (uint64_t)(cmd->exit_ns - cmd->start_ns));
}

static void cmd_check_done(struct cmd *cmd, int64_t now)
{
	if (cmd->dead || cmd->finished || !cmd->sup_exited)
		return;
	if (cmd->out_fd >= 0 || cmd->err_fd >= 0) {
		if (now < cmd->grace_ns)
			return;
		cmd_read_output(cmd, 0, 1u << 20);
		cmd_read_output(cmd, 1, 1u << 20);
	}
	close_fd(&cmd->out_fd);
	close_fd(&cmd->err_fd);
	close_fd(&cmd->in_fd);
	close_fd(&cmd->ctl_fd);
	close_fd(&cmd->sup_fd);
	close_fd(&cmd->pty_fd);
	buf_free(&cmd->stdin_buf);
	struct conn *c = cmd->conn;
	if (c) {
		unsigned char z[16];
		cmd_exit_payload(cmd, z);
		c->cmd = NULL;
		cmd->conn = NULL;
		c->state = CS_CLOSING;
		if (conn_frame(c, 'Z', z, 16, NULL, 0) < 0)
			conn_lost(c);
		else if (cmd->keep)
			c->z_serial = cmd->serial;
	}
	if (cmd->keep && !cmd->failed) { /* the status waits for the edge (or expiry) */
		cmd->finished = 1;
		cmd->done_ns = now;
		return;
	}
	cmd->dead = 1;
}

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif

/* A new terminal in the sandbox's own devpts: master for the agent, slave for the command. */
static int open_pty(int *master, int *slave, uint32_t rows, uint32_t cols)
{
	*master = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (*master < 0)
		return -1;
	int unlock = 0;
	if (ioctl(*master, TIOCSPTLCK, &unlock) < 0)
		return -1;
	/* TIOCGPTPEER opens the peer without a path lookup, so nothing can be swapped in */
	*slave = ioctl(*master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (*slave < 0)
		return -1;
	if (rows && cols) {
		struct winsize ws = {(unsigned short)rows, (unsigned short)cols, 0, 0};
		ioctl(*master, TIOCSWINSZ, &ws);
	}
	return 0;
}

static void start_exec(struct conn *c, const unsigned char *p, uint32_t n)
{
	struct exec_req r;
	char err[256];
	int e = parse_exec(p, n, &r, err, sizeof err);
	if (e) {
		conn_fail(c, e, err);
		return;
	}
	int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, pctl[2] = {-1, -1}, psup[2] = {-1, -1};
	int master = -1, slave = -1, pty = (r.flags & EXEC_FLAG_PTY) != 0;
	if (r.flags & EXEC_FLAG_KEEP) {
		int kept = 0;
		for (struct cmd *k = g_cmds; k; k = k->next) {
			if (!k->keep || k->dead)
				continue;
			kept++;
			if (!strcmp(k->key, r.key)) {
				conn_fail(c, EEXIST, "a kept process with this key exists");
				free_req(&r);
				return;
			}
		}
		if (kept >= KEEP_MAX) {
			conn_fail(c, EAGAIN, "too many kept processes in this sandbox");
			free_req(&r);
			return;
		}
	}
	struct cmd *cmd = calloc(1, sizeof *cmd);
	if (cmd && (r.flags & EXEC_FLAG_KEEP)) {
		static uint64_t serials;
		g_kept++;
		cmd->keep = 1;
		cmd->serial = ++serials;
		cmd->key = strdup(r.key);
		cmd->meta = strdup(r.meta);
		cmd->ring_cap = r.ring < 4096 ? 4096 : r.ring > KEEP_RING_MAX ? KEEP_RING_MAX : r.ring;
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		cmd->wall_ns = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
		if (!cmd->key || !cmd->meta) {
			g_kept--;
			free(cmd->key);
			free(cmd->meta);
			free(cmd);
			cmd = NULL;
		}
	}
	if (cmd && cmd->keep) /* one more share: the others shrink to theirs now */
		for (struct cmd *k = g_cmds; k; k = k->next)
			if (k->keep && !k->dead)
				keep_trim(k, 0);
	if (!cmd || pipe2(pctl, O_CLOEXEC) || pipe2(psup, O_CLOEXEC)) {
		e = cmd ? errno : ENOMEM;
		goto fail;
	}
	if (pty ? open_pty(&master, &slave, r.rows, r.cols) < 0
		: (pipe2(pin, O_CLOEXEC) || pipe2(pout, O_CLOEXEC) || pipe2(perr, O_CLOEXEC))) {
		e = errno;
		goto fail;
	}
	int64_t t0 = now_ns();
	int fds[5] = {pin[0], pout[1], perr[1], pctl[1], psup[0]};
	if (pty)
		fds[0] = fds[1] = fds[2] = slave;
	g_spare_wanted = 1;
	pid_t pid = spare_take(p, n, fds);
	if (!pid) {
		pid = fork();
		if (pid == 0)
			supervisor_main(&r, fds);
	}
	if (pid < 0) {
		e = errno;
		goto fail;
	}
	close_fd(&pin[0]);
	close_fd(&pout[1]);
	close_fd(&perr[1]);
	close_fd(&slave);
	close(pctl[1]);
	close(psup[0]);
	cmd->sup = pid;
	cmd->pty_fd = -1;
	if (pty) {
		cmd->out_fd = master;
		cmd->in_fd = fcntl(master, F_DUPFD_CLOEXEC, 0);
		cmd->pty_fd = fcntl(master, F_DUPFD_CLOEXEC, 0);
		cmd->err_fd = -1;
	} else {
		cmd->in_fd = pin[1];
		cmd->out_fd = pout[0];
		cmd->err_fd = perr[0];
	}
	cmd->ctl_fd = pctl[0];
	cmd->sup_fd = psup[1];
	set_nonblock(cmd->in_fd, 1);
	set_nonblock(cmd->out_fd, 1);
	if (cmd->err_fd >= 0)
		set_nonblock(cmd->err_fd, 1);
	set_nonblock(cmd->ctl_fd, 1);
	set_nonblock(cmd->sup_fd, 1);
	if (!(r.flags & EXEC_FLAG_STDIN))
		close_fd(&cmd->in_fd); /* the command reads EOF at once */
	cmd->budget = r.max_output;
	cmd->start_ns = t0;
	cmd->deadline_ns = r.timeout_ms ? t0 + (int64_t)r.timeout_ms * 1000000LL : 0;
	cmd->conn = c;
	cmd->next = g_cmds;
	g_cmds = cmd;
	c->cmd = cmd;
	c->state = CS_EXEC;
	free_req(&r);
	return;
fail:
	for (int i = 0; i < 2; i++) {
		close_fd(&pin[i]);
		close_fd(&pout[i]);
		close_fd(&perr[i]);
		close_fd(&pctl[i]);
		close_fd(&psup[i]);
	}
	close_fd(&master);
	close_fd(&slave);
	if (cmd) {
		if (cmd->keep)
			g_kept--;
		free(cmd->key);
		free(cmd->meta);
		free(cmd);
	}
	free_req(&r);
	snprintf(err, sizeof err, "cannot start a process: %s", strerror(e));
	conn_fail(c, e, err);
}

/* ------------------------------------------------------------------------------------ */
/* file operations: in a forked child that has become the caller's user, so the kernel  */
/* checks every permission and resolves every path inside the sandbox                   */

static int write_all(int fd, const void *b, size_t n)
{
	const unsigned char *p = b;
	while (n) {
		ssize_t k = write(fd, p, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

static void fo_send(int s, int type, const void *a, size_t an, const void *b, size_t bn)
{
	unsigned char h[FRAME_HDR];
	h[0] = (unsigned char)type;
	put_u32(h + 1, (uint32_t)(an + bn));
	if (write_all(s, h, FRAME_HDR) || write_all(s, a, an) || write_all(s, b, bn))
		_exit(1);
}

/* After the reply: let the client read it and close first (closing on unread input
 * would reset the connection and could destroy the reply). */
static void __attribute__((noreturn)) fo_linger(int s)
{
	struct timeval tv = {LINGER_NS / 1000000000LL, 0};
	shutdown(s, SHUT_WR);
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	while (read(s, g_iobuf, sizeof g_iobuf) > 0) {
	}
	_exit(0);
}

static void __attribute__((noreturn, format(printf, 3, 4))) fo_fail(int s, int err, const char *fmt, ...)
{
	char msg[1200];
	unsigned char e[4];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	put_u32(e, (uint32_t)err);
	fo_send(s, 'F', e, 4, msg, strlen(msg));
	fo_linger(s);
}

/* Read one whole frame into in (blocking). Returns 0, or -1 on EOF/error. */
static int fo_read_frame(int s, struct buf *in, int *type, const unsigned char **payload, uint32_t *len)
{
	for (;;) {
		if (in->len >= FRAME_HDR) {
			const unsigned char *h = in->p + in->off;
			uint32_t n = get_u32(h + 1);
			if (n > MAX_FRAME)
				return -1;
			if (in->len >= FRAME_HDR + n) {
				*type = h[0];
				*payload = h + FRAME_HDR;
				*len = n;
				return 0;
			}
		}
		ssize_t k = read(s, g_iobuf, sizeof g_iobuf);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0 || buf_add(in, g_iobuf, (size_t)k))
			return -1;
	}
}

static void check_path(int s, const char *path)
{
	if (path[0] != '/')
		fo_fail(s, EINVAL, "path must be absolute: '%s'", path);
}

static void __attribute__((noreturn)) do_read(int s, uint64_t max, const char *path)
{
	check_path(s, path);
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0)
		fo_fail(s, errno, "cannot open '%s' for reading: %s", path, strerror(errno));
	struct stat st;
	if (fstat(fd, &st) < 0)
		fo_fail(s, errno, "cannot stat '%s': %s", path, strerror(errno));
	if (S_ISDIR(st.st_mode))
		fo_fail(s, EISDIR, "'%s' is a directory", path);
	if (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode))
		fo_fail(s, EINVAL, "'%s' is not a regular file", path);
	if (S_ISREG(st.st_mode) && (uint64_t)st.st_size > max)
		fo_fail(s, EFBIG, "'%s' is %llu bytes, more than the limit of %llu bytes", path,
			(unsigned long long)st.st_size, (unsigned long long)max);
	int regular = S_ISREG(st.st_mode);
	if (regular)
		set_nonblock(fd, 0);
	uint64_t total = 0;
	for (;;) {
		ssize_t k = read(fd, g_iobuf + FRAME_HDR, CHUNK);
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0 && errno == EAGAIN && !regular) {
			/* a device that may never have data: also watch for the client giving up */
			struct pollfd pf[2] = {{fd, POLLIN, 0}, {s, POLLRDHUP, 0}};
			if (poll(pf, 2, -1) < 0 && errno != EINTR)
				fo_fail(s, errno, "cannot read '%s': %s", path, strerror(errno));
			if (pf[1].revents)
				_exit(1);
			continue;
		}
		if (k < 0)
			fo_fail(s, errno, "cannot read '%s': %s", path, strerror(errno));
		if (k == 0)
			break;
		total += (uint64_t)k;
		if (total > max)
			fo_fail(s, EFBIG, "'%s' is more than the limit of %llu bytes", path, (unsigned long long)max);
		g_iobuf[0] = 'D';
		put_u32(g_iobuf + 1, (uint32_t)k);
		if (write_all(s, g_iobuf, FRAME_HDR + (size_t)k))
			_exit(1);
	}
	unsigned char t[8];
	put_u64(t, total);
	fo_send(s, 'Y', t, 8, NULL, 0);
	fo_linger(s);
}

static int mkdir_p(const char *dir)
{
	char b[PATH_MAX];
	size_t l = strlen(dir);
	if (l >= sizeof b) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(b, dir, l + 1);
	for (char *q = b + 1;; q++) {
		if (*q == '/' || !*q) {
			char saved = *q;
			*q = 0;
			if (mkdir(b, 0755) < 0 && errno != EEXIST)
				return -1;
			*q = saved;
			if (!saved)
				break;
		}
	}
	return 0;
}

static void __attribute__((noreturn)) do_write(int s, struct buf *in, uint32_t mode, uint32_t flags, const char *path)
{
	check_path(s, path);
	size_t pl = strlen(path);
	if (pl >= PATH_MAX)
		fo_fail(s, ENAMETOOLONG, "path is too long (%zu bytes)", pl);
	const char *slash = strrchr(path, '/');
	const char *base = slash + 1;
	if (!*base || strcmp(base, ".") == 0 || strcmp(base, "..") == 0)
		fo_fail(s, EINVAL, "'%s' does not name a file", path);
	char dir[PATH_MAX], tmpl[PATH_MAX + 300];
	size_t dl = (size_t)(slash - path);
	memcpy(dir, path, dl);
	dir[dl] = 0;
	if ((flags & WRITE_FLAG_PARENTS) && dl && mkdir_p(dir) < 0)
		fo_fail(s, errno, "cannot create the parent directories of '%s': %s", path, strerror(errno));
	snprintf(tmpl, sizeof tmpl, "%s/.%.200s.dsec-XXXXXX", dir, base);
	int fd = mkostemp(tmpl, O_CLOEXEC);
	if (fd < 0)
		fo_fail(s, errno, "cannot create '%s': %s", path, strerror(errno));
	uint64_t total = 0;
	for (;;) {
		int type;
		const unsigned char *p;
		uint32_t n;
		if (fo_read_frame(s, in, &type, &p, &n) < 0) {
			unlink(tmpl); /* the client went away: leave nothing behind */
			_exit(1);
		}
		if (type == 'C')
			break;
		if (type != 'D') {
			unlink(tmpl);
			fo_fail(s, EINVAL, "protocol error: unexpected frame %d while writing", type);
		}
		if (write_all(fd, p, n) < 0) {
			int e = errno;
			unlink(tmpl);
			fo_fail(s, e, "cannot write '%s': %s", path, strerror(e));
		}
		total += n;
		buf_drop(in, FRAME_HDR + n);
	}
	if (fchmod(fd, mode & 07777) < 0 || close(fd) < 0) {
		int e = errno;
		unlink(tmpl);
		fo_fail(s, e, "cannot write '%s': %s", path, strerror(e));
	}
	if (rename(tmpl, path) < 0) {
		int e = errno;
		unlink(tmpl);
		fo_fail(s, e, "cannot replace '%s': %s", path, strerror(e));
	}
	unsigned char t[8];
	put_u64(t, total);
	fo_send(s, 'Y', t, 8, NULL, 0);
	fo_linger(s);
}

/* ---- 'O': metadata operations (stat, list, mkdir, remove, move, chmod, symlink) ------- */
/* An entry record: u32 mode, u32 uid, u32 gid, u64 size, i64 mtime_ns, str name, str target */

static char g_link[PATH_MAX];

static int fs_record(struct buf *b, const struct stat *st, const char *name, const char *target)
{
	unsigned char r[32];
	put_u32(r, (uint32_t)st->st_mode);
	put_u32(r + 4, (uint32_t)st->st_uid);
	put_u32(r + 8, (uint32_t)st->st_gid);
	put_u64(r + 12, (uint64_t)st->st_size);
	put_u64(r + 20, (uint64_t)((int64_t)st->st_mtim.tv_sec * 1000000000LL + st->st_mtim.tv_nsec));
	unsigned char nl[4], tl[4];
	put_u32(nl, (uint32_t)strlen(name));
	put_u32(tl, (uint32_t)strlen(target));
	if (buf_add(b, r, 28) || buf_add(b, nl, 4) || buf_add(b, name, strlen(name)) || buf_add(b, tl, 4) ||
	    buf_add(b, target, strlen(target)))
		return -1;
	return 0;
}

static const char *link_target(int dfd, const char *name, const struct stat *st)
{
	g_link[0] = 0;
	if (S_ISLNK(st->st_mode)) {
		ssize_t k = readlinkat(dfd, name, g_link, sizeof g_link - 1);
		g_link[k > 0 ? k : 0] = 0;
	}
	return g_link;
}

struct lister {
	int s;
	struct buf out;
	uint64_t count, limit;
	int truncated;
};

static void list_flush(struct lister *L, int force)
{
	if (L->out.len && (force || L->out.len > CHUNK - 8192)) {
		fo_send(L->s, 'D', L->out.p + L->out.off, L->out.len, NULL, 0);
		buf_drop(&L->out, L->out.len);
	}
}

/* Entries below dfd (which this takes over), named relative to the listed directory.
 * Subdirectories are opened with O_NOFOLLOW: a symlink is reported, never walked into. */
static void list_dir(struct lister *L, int dfd, char *rel, size_t rl, int recursive, int depth)
{
	DIR *d = fdopendir(dfd);
	if (!d) {
		close(dfd);
		return;
	}
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		if (L->count >= L->limit) {
			L->truncated = 1;
			break;
		}
		struct stat st;
		size_t nl = strlen(e->d_name);
		if (rl + nl + 2 > PATH_MAX || fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0)
			continue;
		size_t end = rl;
		if (end)
			rel[end++] = '/';
		memcpy(rel + end, e->d_name, nl + 1);
		if (fs_record(&L->out, &st, rel, link_target(dirfd(d), e->d_name, &st)) < 0)
			fo_fail(L->s, ENOMEM, "out of memory");
		L->count++;
		list_flush(L, 0);
		if (recursive && S_ISDIR(st.st_mode) && depth < LIST_MAX_DEPTH) {
			int sub = openat(dirfd(d), e->d_name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
			if (sub >= 0)
				list_dir(L, sub, rel, end + nl, recursive, depth + 1);
		}
		rel[rl] = 0;
	}
	closedir(d);
}

/* Remove name (below dfd) and, for a directory, everything in it; never follows symlinks
 * and never descends into another file system mounted inside. Returns 0 or -1 (errno). */
static int rm_tree_at(int dfd, const char *name, dev_t dev, int depth, char *failed, size_t fl)
{
	struct stat st;
	if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) < 0)
		return errno == ENOENT ? 0 : -1;
	if (!S_ISDIR(st.st_mode)) {
		if (unlinkat(dfd, name, 0) == 0 || errno == ENOENT)
			return 0;
		snprintf(failed, fl, "%s", name);
		return -1;
	}
	if (st.st_dev != dev || depth > 4 * LIST_MAX_DEPTH) {
		snprintf(failed, fl, "%s", name);
		errno = st.st_dev != dev ? EXDEV : ELOOP;
		return -1;
	}
	int sub = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	DIR *d = sub >= 0 ? fdopendir(sub) : NULL;
	if (!d) {
		if (sub >= 0)
			close(sub);
		snprintf(failed, fl, "%s", name);
		return -1;
	}
	int rc = 0, err = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		if (rm_tree_at(dirfd(d), e->d_name, dev, depth + 1, failed, fl) < 0 && !rc) {
			rc = -1;
			err = errno;
		}
	}
	closedir(d);
	if (rc) {
		errno = err;
		return -1;
	}
	if (unlinkat(dfd, name, AT_REMOVEDIR) < 0) {
		snprintf(failed, fl, "%s", name);
		return -1;
	}
	return 0;
}

static void __attribute__((noreturn)) fo_done(int s, const void *payload, size_t n)
{
	unsigned char z[8] = {0};
	if (payload)
		fo_send(s, 'Y', payload, n, NULL, 0);
	else
		fo_send(s, 'Y', z, 8, NULL, 0);
	fo_linger(s);
}

static void __attribute__((noreturn)) do_fs(int s, uint32_t op, uint32_t flags, uint32_t mode, uint64_t limit,
					    const char *path, const char *path2)
{
	check_path(s, path);
	struct stat st;
	switch (op) {
	case FS_STAT: {
		int r = (flags & FS_FLAG_FOLLOW) ? stat(path, &st) : lstat(path, &st);
		if (r < 0)
			fo_fail(s, errno, "cannot stat '%s': %s", path, strerror(errno));
		struct buf b = {0};
		if (fs_record(&b, &st, path, link_target(AT_FDCWD, path, &st)) < 0)
			fo_fail(s, ENOMEM, "out of memory");
		fo_done(s, b.p + b.off, b.len);
	}
	case FS_LIST: {
		int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
		if (dfd < 0)
			fo_fail(s, errno, "cannot list '%s': %s", path, strerror(errno));
		struct lister L = {s, {0}, 0, limit ? limit : UINT64_MAX, 0};
		static char rel[PATH_MAX];
		rel[0] = 0;
		list_dir(&L, dfd, rel, 0, (flags & FS_FLAG_RECURSIVE) != 0, 0);
		list_flush(&L, 1);
		unsigned char t[12];
		put_u64(t, L.count);
		put_u32(t + 8, (uint32_t)L.truncated);
		fo_done(s, t, 12);
	}
	case FS_MKDIR:
		if (flags & FS_FLAG_PARENTS) {
			char parent[PATH_MAX];
			snprintf(parent, sizeof parent, "%s", path);
			char *slash = strrchr(parent, '/');
			if (slash && slash != parent) {
				*slash = 0;
				if (mkdir_p(parent) < 0)
					fo_fail(s, errno, "cannot create '%s': %s", parent, strerror(errno));
			}
		}
		if (mkdir(path, mode & 07777) < 0) {
			int e = errno;
			if (!(e == EEXIST && (flags & FS_FLAG_PARENTS) && stat(path, &st) == 0 && S_ISDIR(st.st_mode)))
				fo_fail(s, e, "cannot create directory '%s': %s", path, strerror(e));
		}
		fo_done(s, NULL, 0);
	case FS_REMOVE: {
		if (lstat(path, &st) < 0)
			fo_fail(s, errno, "cannot remove '%s': %s", path, strerror(errno));
		if (strcmp(path, "/") == 0)
			fo_fail(s, EINVAL, "refusing to remove '/'");
		int r;
		char failed[NAME_MAX + 1] = "";
		if (!S_ISDIR(st.st_mode))
			r = unlink(path);
		else if (flags & FS_FLAG_RECURSIVE)
			r = rm_tree_at(AT_FDCWD, path, st.st_dev, 0, failed, sizeof failed);
		else
			r = rmdir(path);
		if (r < 0) {
			int e = errno;
			if (e == ENOTEMPTY || e == EEXIST)
				fo_fail(s, ENOTEMPTY, "cannot remove '%s': directory not empty (use recursive)", path);
			fo_fail(s, e, "cannot remove '%s'%s%s: %s", path, failed[0] ? " (at " : "",
				failed[0] ? failed : "", strerror(e));
		}
		fo_done(s, NULL, 0);
	}
	case FS_MOVE:
		check_path(s, path2);
		if (rename(path, path2) < 0) {
			int e = errno;
			if (e == EXDEV)
				fo_fail(s, e, "cannot move '%s' to '%s': they are on different file systems", path, path2);
			fo_fail(s, e, "cannot move '%s' to '%s': %s", path, path2, strerror(e));
		}
		fo_done(s, NULL, 0);
	case FS_CHMOD:
		if (chmod(path, mode & 07777) < 0)
			fo_fail(s, errno, "cannot chmod '%s': %s", path, strerror(errno));
		fo_done(s, NULL, 0);
	case FS_SYMLINK:
		if (!path2[0])
			fo_fail(s, EINVAL, "a symlink needs a target");
		if (symlink(path2, path) < 0)
			fo_fail(s, errno, "cannot create symlink '%s': %s", path, strerror(errno));
		fo_done(s, NULL, 0);
	default:
		fo_fail(s, EINVAL, "unknown file-system operation %u", op);
	}
}

static void __attribute__((noreturn)) fileop_main(struct conn *c, int type, const unsigned char *p, uint32_t n)
{
	child_signal_mask();
	int fds[1] = {c->fd};
	move_fds(fds, 1, 3);
	int s = 3;
	set_nonblock(s, 0);
	setrlimit(RLIMIT_NOFILE, &g_nofile_orig);
	signal(SIGXFSZ, SIG_IGN); /* exceeding RLIMIT_FSIZE must be an EFBIG error, not death */
	struct timeval tv = {60, 0};
	setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
	setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);

	char *arena = malloc((size_t)n + 1), *a = arena;
	struct rd rd = {p, n, 0};
	uint64_t max = 0;
	uint32_t mode = 0, flags = 0, op = 0;
	char *path2 = NULL;
	if (!arena)
		fo_fail(s, ENOMEM, "out of memory");
	char *user = rd_str(&rd, &a);
	if (type == 'R') {
		max = rd_u64(&rd);
	} else if (type == 'O') {
		op = rd_u32(&rd);
		flags = rd_u32(&rd);
		mode = rd_u32(&rd);
		max = rd_u64(&rd);
	} else {
		mode = rd_u32(&rd);
		flags = rd_u32(&rd);
	}
	char *path = rd_str(&rd, &a);
	if (type == 'O')
		path2 = rd_str(&rd, &a);
	if (rd.bad)
		fo_fail(s, EINVAL, "%s", rd.bad == 2 ? "strings must not contain NUL bytes" : "malformed request");
	buf_drop(&c->in, FRAME_HDR + n); /* what is left are the first data frames */

	struct user_info u;
	char err[512];
	int e = resolve_user(user, &u, err, sizeof err);
	if (e)
		fo_fail(s, e, "%s", err);
	if (switch_user(&u) < 0)
		fo_fail(s, errno, "cannot switch to user '%s': %s", user, strerror(errno));
	prctl(PR_SET_PDEATHSIG, SIGKILL); /* after setuid, which clears it */
	if (getppid() != g_agent_pid)
		_exit(1); /* the agent is already gone */
	if (type == 'R')
		do_read(s, max, path);
	if (type == 'O')
		do_fs(s, op, flags, mode, max, path, path2);
	do_write(s, &c->in, mode, flags, path);
}

static void start_fileop(struct conn *c, int type, const unsigned char *p, uint32_t n)
{
	pid_t pid = fork();
	if (pid == 0)
		fileop_main(c, type, p, n);
	if (pid < 0) {
		char m[200];
		int e = errno;
		snprintf(m, sizeof m, "cannot start a process: %s", strerror(e));
		conn_fail(c, e, m);
		return;
	}
	close_fd(&c->fd); /* the child owns the connection now */
	c->dead = 1;
}

/* ------------------------------------------------------------------------------------ */
/* event loop                                                                           */

/* ------------------------------------------------------------------------------------ */
/* kept commands: list ('L'), re-attach ('A'), forget ('K'); see struct cmd             */

static struct cmd *keep_find(struct rd *rd)
{
	uint32_t kl = rd_u32(rd);
	if (rd->bad || kl > rd->n || kl == 0 || kl > KEEP_KEY_MAX) {
		rd->bad = 1;
		return NULL;
	}
	const unsigned char *kp = rd->p;
	rd->p += kl;
	rd->n -= kl;
	for (struct cmd *k = g_cmds; k; k = k->next)
		if (k->keep && !k->dead && !k->failed && strlen(k->key) == kl && !memcmp(k->key, kp, kl))
			return k;
	return NULL;
}

static int put_strb(struct buf *b, const char *s)
{
	unsigned char l[4];
	put_u32(l, (uint32_t)strlen(s));
	return buf_add(b, l, 4) || buf_add(b, s, strlen(s));
}

/* One 'D' frame per kept command: str key, str meta, u32 pid, u32 state (1 running,
 * 2 exited and its 'Z' delivered to a client, 3 exited and nobody told yet), then the 16 bytes of its 'Z' payload (zero while running), u64 first and
 * next record number, i64 start time (ns since the epoch). 'Y': u64 count. */
static void keep_list(struct conn *c)
{
	uint64_t count = 0;
	int64_t now = now_ns();
	for (struct cmd *k = g_cmds; k; k = k->next) {
		if (!k->keep || k->dead || k->failed || !k->started)
			continue;
		struct buf b = {0};
		unsigned char t[8 + 16 + 24];
		memset(t, 0, sizeof t);
		put_u32(t, (uint32_t)k->pid);
		put_u32(t + 4, !k->finished ? 1 : k->delivered ? 2 : 3);
		if (k->finished) {
			cmd_exit_payload(k, t + 8);
		} else {
			put_u64(t + 16, (uint64_t)(now - k->start_ns));
		}
		put_u64(t + 24, k->first_seq);
		put_u64(t + 32, k->next_seq);
		put_u64(t + 40, (uint64_t)k->wall_ns);
		if (put_strb(&b, k->key) || put_strb(&b, k->meta) || buf_add(&b, t, sizeof t) ||
		    conn_frame(c, 'D', b.p + b.off, b.len, NULL, 0) < 0) {
			buf_free(&b);
			conn_lost(c);
			return;
		}
		buf_free(&b);
		count++;
	}
	unsigned char y[8];
	put_u64(y, count);
	conn_frame(c, 'Y', y, 8, NULL, 0);
	c->state = CS_CLOSING;
}

/* 'A': str key, u64 first record wanted. Answers 'P' (u32 pid), 'B' (u64 number of the
 * first record that follows: later than asked if the ring no longer holds it), the held
 * records, then live output and 'Z' like an exec. A previous client is dropped. */
static void keep_attach(struct conn *c, const unsigned char *p, uint32_t n)
{
	struct rd rd = {p, n, 0};
	struct cmd *cmd = keep_find(&rd);
	uint64_t from = rd_u64(&rd);
	if (rd.bad) {
		conn_fail(c, EINVAL, "malformed attach request");
		return;
	}
	if (!cmd || !cmd->started) {
		conn_fail(c, ENOENT, "no such kept process");
		return;
	}
	if (cmd->conn) {
		struct conn *old = cmd->conn;
		old->cmd = NULL;
		cmd->conn = NULL;
		close_fd(&old->fd);
		old->dead = 1;
	}
	if (from > cmd->next_seq)
		from = cmd->next_seq;
	if (from < cmd->first_seq)
		from = cmd->first_seq;
	unsigned char h[8];
	put_u32(h, (uint32_t)cmd->pid);
	conn_frame(c, 'P', h, 4, NULL, 0);
	put_u64(h, from);
	conn_frame(c, 'B', h, 8, NULL, 0);
	size_t off = 0;
	for (uint64_t seq = cmd->first_seq; seq < from && off + FRAME_HDR <= cmd->ring.len; seq++)
		off += FRAME_HDR + get_u32(cmd->ring.p + cmd->ring.off + off + 1);
	if (off < cmd->ring.len && buf_add(&c->out, cmd->ring.p + cmd->ring.off + off, cmd->ring.len - off) < 0) {
		conn_lost(c);
		return;
	}
	if (cmd->finished) {
		unsigned char z[16];
		cmd_exit_payload(cmd, z);
		if (conn_frame(c, 'Z', z, 16, NULL, 0) == 0)
			c->z_serial = cmd->serial;
		c->state = CS_CLOSING;
		return;
	}
	cmd->conn = c;
	c->cmd = cmd;
	c->state = CS_EXEC;
}

/* 'K': str key. A finished kept command is dropped ('Y' u64 1); a running one stays (0). */
static void keep_forget(struct conn *c, const unsigned char *p, uint32_t n)
{
	struct rd rd = {p, n, 0};
	struct cmd *cmd = keep_find(&rd);
	if (rd.bad) {
		conn_fail(c, EINVAL, "malformed forget request");
		return;
	}
	unsigned char y[8] = {0};
	if (cmd && cmd->finished && !cmd->conn) {
		cmd->dead = 1;
		y[0] = 1;
	}
	conn_frame(c, 'Y', y, 8, NULL, 0);
	c->state = CS_CLOSING;
}

/* Finished kept commands nobody collected: at most KEEP_DONE_MAX, for KEEP_DONE_TTL_NS. */
static void keep_expire(int64_t now)
{
	int done = 0;
	struct cmd *oldest = NULL;
	for (struct cmd *k = g_cmds; k; k = k->next) {
		if (!k->finished || k->dead)
			continue;
		if (!k->conn && now - k->done_ns > KEEP_DONE_TTL_NS) {
			k->dead = 1;
			continue;
		}
		done++;
		if (!k->conn && (!oldest || k->done_ns < oldest->done_ns))
			oldest = k;
	}
	if (done > KEEP_DONE_MAX && oldest)
		oldest->dead = 1;
}

static void conn_first_frame(struct conn *c, int type, const unsigned char *p, uint32_t n)
{
	switch (type) {
	case 'X':
		start_exec(c, p, n);
		break;
	case 'R':
	case 'W':
	case 'O':
		start_fileop(c, type, p, n);
		break;
	case 'H': {
		unsigned char z[8] = {0};
		conn_frame(c, 'Y', z, 8, NULL, 0);
		c->state = CS_CLOSING;
		break;
	}
	case 'Q':
		shutdown_all();
		break;
	case 'N':
		watch_signals(c);
		break;
	case 'L':
		keep_list(c);
		break;
	case 'A':
		keep_attach(c, p, n);
		break;
	case 'K':
		keep_forget(c, p, n);
		break;
	default:
		conn_fail(c, EINVAL, "unknown operation");
	}
}

static void conn_exec_frame(struct conn *c, int type, const unsigned char *p, uint32_t n)
{
	struct cmd *cmd = c->cmd;
	switch (type) {
	case 'I':
		if (cmd->in_fd >= 0 && !cmd->stdin_close) {
			if (buf_add(&cmd->stdin_buf, p, n) < 0) {
				conn_lost(c);
				return;
			}
			cmd_write_stdin(cmd);
		}
		break;
	case 'C':
		cmd->stdin_close = 1;
		cmd_write_stdin(cmd);
		break;
	case 'T':
		if (n >= 8 && cmd->pty_fd >= 0) {
			struct winsize ws = {(unsigned short)get_u32(p), (unsigned short)get_u32(p + 4), 0, 0};
			ioctl(cmd->pty_fd, TIOCSWINSZ, &ws);
		}
		break;
	case 'S':
		if (n >= 4 && cmd->sup_fd >= 0) {
			unsigned char m[5] = {'S'};
			uint32_t sig = get_u32(p);
			if (sig >= 1 && sig < NSIG) {
				put_u32(m + 1, sig);
				if (write(cmd->sup_fd, m, 5) < 0) {
					/* the supervisor is exiting */
				}
			}
		}
		break;
	default:
		conn_lost(c); /* protocol violation: treat like a disconnect */
	}
}

static void conn_process(struct conn *c)
{
	while (!c->dead && c->state != CS_CLOSING && c->state != CS_WATCH && c->in.len >= FRAME_HDR) {
		const unsigned char *h = c->in.p + c->in.off;
		uint32_t n = get_u32(h + 1);
		if (n > MAX_FRAME) {
			if (c->state == CS_HEADER)
				conn_fail(c, EINVAL, "frame too large");
			else
				conn_lost(c);
			return;
		}
		if (c->in.len < FRAME_HDR + n)
			return;
		if (c->state == CS_HEADER)
			conn_first_frame(c, h[0], h + FRAME_HDR, n);
		else
			conn_exec_frame(c, h[0], h + FRAME_HDR, n);
		if (!c->dead)
			buf_drop(&c->in, FRAME_HDR + n);
	}
}

static int conn_wants_read(const struct conn *c)
{
	if (c->rd_eof)
		return 0;
	if (c->state == CS_EXEC)
		return c->cmd && c->cmd->stdin_buf.len < STDIN_HIGH;
	return 1;
}

static void conn_on_readable(struct conn *c, int force)
{
	for (int i = 0; i < 4 && !c->dead; i++) {
		if (!force && !conn_wants_read(c))
			break;
		force = 0;
		ssize_t n = recv(c->fd, g_iobuf, CHUNK, MSG_DONTWAIT);
		if (n > 0) {
			if (c->state == CS_CLOSING || c->state == CS_WATCH)
				continue; /* the reply is out (or none is due); input is discarded */
			if (buf_add(&c->in, g_iobuf, (size_t)n) < 0) {
				conn_lost(c);
				return;
			}
			conn_process(c);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n == 0 && c->state == CS_WATCH) {
			watch_ended(c);
			return;
		}
		conn_lost(c);
	}
}

static void conn_flush(struct conn *c)
{
	while (!c->dead && c->out.len) {
		ssize_t n = send(c->fd, c->out.p + c->out.off, c->out.len, MSG_DONTWAIT | MSG_NOSIGNAL);
		if (n > 0) {
			buf_drop(&c->out, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		conn_lost(c);
		return;
	}
	if (!c->dead && !c->out.len && c->z_serial) {
		for (struct cmd *k = g_cmds; k; k = k->next)
			if (k->serial == c->z_serial)
				k->delivered = 1;
		c->z_serial = 0;
	}
	if (!c->dead && c->out.cap > 4 * CHUNK)
		buf_free(&c->out); /* keep idle memory small */
	if (!c->dead && c->state == CS_CLOSING && !c->wr_shut) {
		shutdown(c->fd, SHUT_WR);
		c->wr_shut = 1;
		c->linger_deadline = now_ns() + LINGER_NS;
		buf_free(&c->in);
		buf_free(&c->out);
	}
}

static void accept_all(void)
{
	for (int i = 0; i < 64; i++) {
		int fd = accept4(g_lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		if (fd < 0) {
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
				warnx("accept: %s; pausing", strerror(errno));
				g_accept_pause_until = now_ns() + 100000000LL;
			}
			return;
		}
		struct conn *c = calloc(1, sizeof *c);
		if (!c) {
			close(fd);
			return;
		}
		c->fd = fd;
		c->state = CS_HEADER;
		c->next = g_conns;
		g_conns = c;
		conn_on_readable(c, 0); /* the request usually arrived with the connection */
	}
}

static void reap_all(void)
{
	int st;
	pid_t pid;
	while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
		if (pid == g_spare) { /* killed before it was used */
			spare_drop();
			continue;
		}
		for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next) {
			if (cmd->sup == pid && !cmd->sup_exited) {
				on_sup_exit(cmd, st);
				break;
			}
		}
	}
}

static void __attribute__((noreturn)) shutdown_all(void)
{
	/* When a namespace's init exits, the kernel kills everything else in it and waits
	 * for it (no kill(-1) of ours: the seccomp profile refuses and records that call). */
	if (g_pid1)
		_exit(0);
	int64_t end = now_ns() + 1000000000LL;
	for (;;) {
		int left = signal_descendants(getpid(), SIGKILL);
		while (waitpid(-1, NULL, WNOHANG) > 0) {
		}
		int st;
		if (left <= 0 && waitpid(-1, &st, WNOHANG) < 0 && errno == ECHILD)
			break;
		if (now_ns() > end)
			break;
		usleep(2000);
	}
	_exit(0);
}

static void on_signal(void)
{
	struct signalfd_siginfo si;
	for (int i = 0; i < SIG_READS && read(g_sfd, &si, sizeof si) == (ssize_t)sizeof si; i++) {
		int code = si.ssi_code, stop = si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT;
		if (si.ssi_signo == SIGCHLD && code > 0 && code <= CLD_CONTINUED)
			continue; /* a child changed state (the kernel's own code): reaped below */
		if (!g_pid1) { /* a plain subreaper (tests, FnCall-less hosts): obey as before */
			if (stop)
				shutdown_all();
			continue;
		}
		if (code == SI_USER && si.ssi_pid == 0) { /* from an ancestor namespace: the host */
			if (stop)
				shutdown_all();
			continue;
		}
		if (code == SI_USER && si.ssi_pid == (uint32_t)g_agent_pid)
			continue; /* our own SIGPIPE, from a write to a pipe a command closed */
		note_signal(&si);
	}
	reap_all(); /* SIGCHLD coalesces; reaping is cheap */
}

static void run_timers(int64_t now)
{
	for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next) {
		if (!cmd->dead && cmd->deadline_ns && !cmd->timed_out && !cmd->sup_exited && !cmd->failed &&
		    now >= cmd->deadline_ns) {
			cmd->timed_out = 1;
			cmd_kill(cmd);
		}
	}
	for (struct conn *c = g_conns; c; c = c->next)
		if (!c->dead && c->wr_shut && now >= c->linger_deadline) {
			close_fd(&c->fd);
			c->dead = 1;
		}
	if (g_spare && now >= g_spare_until)
		spare_drop();
}

/* Fork a spare supervisor now? Only after a command started since the last one, and
 * only while no foreground command is starting or running (see spare_start). */
static void spare_refill(void)
{
	if (!g_spare_wanted || g_spare || g_spare_idle_ns <= 0)
		return;
	for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next)
		if (!cmd->dead && !cmd->keep && !cmd->sup_exited)
			return;
	g_spare_wanted = 0;
	spare_start();
}

static int poll_timeout(int64_t now)
{
	int64_t next = INT64_MAX;
	for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next) {
		if (cmd->dead || cmd->finished)
			continue;
		if (cmd->sup_exited && cmd->grace_ns < next)
			next = cmd->grace_ns;
		if (!cmd->sup_exited && cmd->deadline_ns && !cmd->timed_out && cmd->deadline_ns < next)
			next = cmd->deadline_ns;
	}
	for (struct conn *c = g_conns; c; c = c->next)
		if (!c->dead && c->wr_shut && c->linger_deadline < next)
			next = c->linger_deadline;
	if (g_accept_pause_until > now && g_accept_pause_until < next)
		next = g_accept_pause_until;
	if (g_spare && g_spare_until < next)
		next = g_spare_until;
	if (next == INT64_MAX)
		return -1;
	if (next <= now)
		return 0;
	int64_t ms = (next - now + 999999) / 1000000;
	return ms > 60000 ? 60000 : (int)ms;
}

static void collect_garbage(void)
{
	keep_expire(now_ns());
	for (struct conn **pc = &g_conns; *pc;) {
		struct conn *c = *pc;
		if (c->dead) {
			if (c == g_watcher)
				g_watcher = NULL;
			*pc = c->next;
			close_fd(&c->fd);
			buf_free(&c->in);
			buf_free(&c->out);
			free(c);
		} else {
			pc = &c->next;
		}
	}
	for (struct cmd **pm = &g_cmds; *pm;) {
		struct cmd *cmd = *pm;
		if (cmd->dead) {
			*pm = cmd->next;
			if (cmd->conn) { /* forgotten or expired while a client followed it */
				cmd->conn->cmd = NULL;
				cmd->conn->state = CS_CLOSING;
			}
			if (cmd->keep)
				g_kept--;
			free(cmd->key);
			free(cmd->meta);
			buf_free(&cmd->ring);
			free(cmd);
		} else {
			pm = &cmd->next;
		}
	}
}

enum { K_SIG, K_LISTEN, K_CONN, K_OUT, K_ERR, K_IN, K_CTL };

struct slot {
	int kind;
	void *obj;
};

static struct pollfd *g_pfd;
static struct slot *g_slot;
static size_t g_np, g_pcap;

static void add_poll(int fd, short events, int kind, void *obj)
{
	if (g_np == g_pcap) {
		size_t nc = g_pcap ? g_pcap * 2 : 64;
		struct pollfd *np = realloc(g_pfd, nc * sizeof *np);
		if (!np)
			return;
		g_pfd = np;
		struct slot *ns = realloc(g_slot, nc * sizeof *ns);
		if (!ns)
			return;
		g_slot = ns;
		g_pcap = nc;
	}
	g_pfd[g_np].fd = fd;
	g_pfd[g_np].events = events;
	g_pfd[g_np].revents = 0;
	g_slot[g_np].kind = kind;
	g_slot[g_np].obj = obj;
	g_np++;
}

static void noop_handler(int sig)
{
	(void)sig;
}

static int agent_main(void)
{
	prctl(PR_SET_DUMPABLE, 0);
	/* Output rings and connection buffers of 64 KiB and more get their own mappings, so
	 * memory goes back to the system when they shrink or end (a fixed threshold: glibc's
	 * sliding one would move them onto the heap, where freed space stays resident). */
	mallopt(M_MMAP_THRESHOLD, 64 * 1024);
	mallopt(M_TRIM_THRESHOLD, 128 * 1024);
	g_agent_pid = getpid();
	g_pid1 = g_agent_pid == 1;
	if (!g_pid1)
		prctl(PR_SET_CHILD_SUBREAPER, 1); /* orphans come to us, as they would to pid 1 */
	umask(022);
	if (chdir("/") < 0)
		warnx("chdir /: %s", strerror(errno));

	const char *fdenv = getenv("DSEC_AGENT_FD");
	g_lfd = fdenv && *fdenv ? atoi(fdenv) : 3;
	int acc = 0;
	socklen_t al = sizeof acc;
	if (g_lfd < 0 || getsockopt(g_lfd, SOL_SOCKET, SO_ACCEPTCONN, &acc, &al) < 0 || !acc) {
		warnx("fd %d (DSEC_AGENT_FD) is not a listening socket", g_lfd);
		return 2;
	}
	unsetenv("DSEC_AGENT_FD");
	const char *idle = getenv("DSEC_AGENT_SPARE_IDLE_MS");
	if (idle && *idle)
		g_spare_idle_ns = atoll(idle) * 1000000LL;
	unsetenv("DSEC_AGENT_SPARE_IDLE_MS");
	for (int fd = 0; fd < 3; fd++)
		set_cloexec(fd);
	set_cloexec(g_lfd);
	set_nonblock(g_lfd, 1);
	if (g_lfd > 3)
		close_range(3, (unsigned)g_lfd - 1, 0);
	close_from(g_lfd + 1 > 3 ? g_lfd + 1 : 3);

	getrlimit(RLIMIT_NOFILE, &g_nofile_orig);
	struct rlimit rl = g_nofile_orig;
	rl.rlim_cur = rl.rlim_max > 65536 ? 65536 : rl.rlim_max;
	if (rl.rlim_cur > g_nofile_orig.rlim_cur)
		setrlimit(RLIMIT_NOFILE, &rl);

	/* Signals arrive through a signalfd, all of them (see "signals sent to pid 1"): a
	 * blocked signal is queued even for a namespace's init, so each one is seen. The
	 * handlers are for forked helpers, which get the narrower mask back. */
	struct sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.sa_handler = SIG_DFL; /* nothing inherited (an ignored signal) reaches a command */
	for (int s = 1; s < NSIG; s++)
		sigaction(s, &sa, NULL);
	sa.sa_handler = noop_handler;
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sa.sa_handler = SIG_IGN;
	sigaction(SIGPIPE, &sa, NULL);
	block_all_signals();
	g_sfd = (int)syscall(SYS_signalfd4, -1, &ALL_SIGNALS, sizeof ALL_SIGNALS,
			     SFD_CLOEXEC | SFD_NONBLOCK);
	if (g_sfd < 0) {
		warnx("signalfd: %s", strerror(errno));
		return 2;
	}
	reap_all();

	for (;;) {
		int64_t now = now_ns();
		run_timers(now);
		for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next)
			cmd_check_done(cmd, now);
		if (g_note_len || g_notes_lost)
			flush_notes(); /* the watcher caught up, or a new one arrived */
		for (struct conn *c = g_conns; c; c = c->next)
			if (!c->dead && (c->out.len || (c->state == CS_CLOSING && !c->wr_shut)))
				conn_flush(c);
		collect_garbage();
		spare_refill(); /* after the flush: a finished command's 'Z' is on its way first */

		g_np = 0;
		add_poll(g_sfd, POLLIN, K_SIG, NULL);
		if (now >= g_accept_pause_until)
			add_poll(g_lfd, POLLIN, K_LISTEN, NULL);
		for (struct conn *c = g_conns; c; c = c->next) {
			short ev = (short)((conn_wants_read(c) ? POLLIN : 0) | (c->out.len ? POLLOUT : 0));
			add_poll(c->fd, ev, K_CONN, c); /* events may be 0: hangups are still reported */
		}
		for (struct cmd *cmd = g_cmds; cmd; cmd = cmd->next) {
			if (cmd->ctl_fd >= 0)
				add_poll(cmd->ctl_fd, POLLIN, K_CTL, cmd);
			if (cmd->started && cmd_wants_output(cmd)) {
				if (cmd->out_fd >= 0)
					add_poll(cmd->out_fd, POLLIN, K_OUT, cmd);
				if (cmd->err_fd >= 0)
					add_poll(cmd->err_fd, POLLIN, K_ERR, cmd);
			}
			if (cmd->in_fd >= 0 && cmd->stdin_buf.len)
				add_poll(cmd->in_fd, POLLOUT, K_IN, cmd);
		}
		if (poll(g_pfd, g_np, poll_timeout(now)) < 0) {
			if (errno != EINTR) {
				warnx("poll: %s", strerror(errno));
				usleep(10000);
			}
			continue;
		}
		for (size_t i = 0; i < g_np; i++) {
			short re = g_pfd[i].revents;
			if (!re)
				continue;
			struct conn *c = g_slot[i].obj;
			struct cmd *cmd = g_slot[i].obj;
			switch (g_slot[i].kind) {
			case K_SIG:
				on_signal();
				break;
			case K_LISTEN:
				accept_all();
				break;
			case K_CONN:
				if (c->dead)
					break;
				if (re & (POLLIN | POLLHUP | POLLERR))
					conn_on_readable(c, !(g_pfd[i].events & POLLIN));
				if (!c->dead && (re & POLLOUT))
					conn_flush(c);
				break;
			case K_OUT:
			case K_ERR:
				if (!cmd->dead)
					cmd_read_output(cmd, g_slot[i].kind == K_ERR, 4 * CHUNK);
				break;
			case K_IN:
				if (!cmd->dead)
					cmd_write_stdin(cmd);
				break;
			case K_CTL:
				if (!cmd->dead)
					cmd_read_ctl(cmd);
				break;
			}
		}
	}
}

/* ------------------------------------------------------------------------------------ */
/* host-side helper for every OCI runtime call:                                         */
/*   crun-wrap EMPTY_FILE CRUN_PATH [ARGS...]                                           */
/*   crun-wrap [--fd N] [--mask-cgroup2 EMPTY_FILE]                                     */
/*             [--overlay-target DIR --overlay-data OPTS]                                 */
/*             [--dev-tmpfs DIR --dev-data OPTS] [--cgroup-view DIR]                    */
/*             [--cgroup-park DIR]... [--session-keyring new] -- CRUN_PATH [ARGS...]     */
/* --fd N puts the listening agent socket at fd 3 for --preserve-fds=1. The mask exists */
/* because crun 1.8.1 refuses hybrid cgroup hosts unless it sees an empty unified        */
/* cgroup.controllers: a private mount namespace hides the real one from crun only.      */
/* --overlay-* mounts the sandbox's root overlay in that private namespace only, so the */
/* host's mount table does not grow with every sandbox: each new mount namespace copies */
/* its parent's mounts, which made every create O(number of sandboxes). The overlay     */
/* then lives only in the container's namespace and the kernel unmounts it when the     */
/* sandbox's last process exits: nothing to leak on the host.                           */
/* --dev-* mounts the sandbox's one tmpfs for /dev and /dev/shm there too (see dev_tmpfs). */
/* --cgroup-view DIR: a tmpfs the platform made with one empty directory per cgroup v1  */
/* hierarchy a sandbox joins (CgroupHost.sandbox_hierarchies). Each of those            */
/* hierarchies is moved into it and it is moved over /sys/fs/cgroup, in the private     */
/* namespace only: crun 1.8 joins only the hierarchies whose /sys/fs/cgroup/NAME exists */
/* for it (no "unified": it runs in v1 mode), so it makes no cgroup in the others       */
/* (cpuset, blkio, name=systemd here: each cost kernel work growing with the number of  */
/* sandboxes). --cgroup-park DIR (repeated; only for calls that start a container):      */
/* first move this process into the cgroup DIR of each hierarchy the sandbox does not   */
/* join. The sandbox inherits it and its cgroup namespace is rooted there: an empty     */
/* cgroup of the platform's, not whatever cgroup the platform itself runs in.           */
/* --session-keyring new: join a new anonymous session keyring, which the container     */
/* inherits (the platform runs crun with --no-new-keyring). crun's own keyring is named */
/* after the container, and joining a named keyring looks the name up among every      */
/* keyring on the host (find_keyring_by_name): a walk over all sandboxes in each create */
/* (5% of crun's time at 5,000 sandboxes, perf). Anonymous, the keyring is just as much */
/* the sandbox's own, and sandboxes cannot reach keyrings anyway (keyctl, add_key and  */
/* request_key are refused by their seccomp filter).                                   */

/* The root overlay's options name host paths (the data directory, the layer and sandbox
 * directories) and the kernel shows them to the sandbox in /proc/self/mountinfo. Name
 * each directory by an fd instead: the kernel resolves /proc/self/fd/N at mount time and
 * keeps the string, so the sandbox sees fd numbers only. The fds are close-on-exec (crun
 * never has them). NULL: leave the options as they are (a path with an escape in it). */
static char *overlay_by_fd(const char *data)
{
	if (strchr(data, '\\'))
		return NULL;
	size_t cap = strlen(data) + 1;
	for (const char *p = data; *p; p++)
		if (*p == ':' || *p == ',' || *p == '=')
			cap += 24;
	char *out = malloc(cap), *copy = strdup(data);
	if (!out || !copy) {
		free(out);
		free(copy);
		return NULL;
	}
	size_t len = 0;
	char *save = NULL;
	for (char *opt = strtok_r(copy, ",", &save); opt; opt = strtok_r(NULL, ",", &save)) {
		const char *keys[] = {"lowerdir=", "upperdir=", "workdir="};
		const char *key = NULL;
		for (size_t k = 0; k < 3 && !key; k++)
			if (strncmp(opt, keys[k], strlen(keys[k])) == 0)
				key = keys[k];
		len += (size_t)snprintf(out + len, cap - len, "%s%s", len ? "," : "", key ? key : opt);
		if (!key)
			continue;
		char *psave = NULL;
		int first = 1;
		for (char *dir = strtok_r(opt + strlen(key), ":", &psave); dir;
		     dir = strtok_r(NULL, ":", &psave)) {
			int fd = open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC);
			if (fd < 0) {
				free(out);
				free(copy);
				return NULL; /* the mount reports what is wrong with the path */
			}
			len += (size_t)snprintf(out + len, cap - len, "%s/proc/self/fd/%d", first ? "" : ":", fd);
			first = 0;
		}
	}
	free(copy);
	return out;
}

/* The sandbox's /dev and /dev/shm on one tmpfs (issue 19): every superblock registers a
 * memory-cgroup-aware shrinker, and every memory cgroup on the host keeps a slot for
 * every shrinker id ever alive, so a second tmpfs per sandbox cost every memory cgroup
 * more as the host filled. The tmpfs is mounted here, in the wrapper's private mount
 * namespace (like the root overlay), the OCI config binds DIR at /dev and DIR/shm at
 * /dev/shm (nosuid,nodev,noexec: the flags a separate shm mount had), and the kernel
 * frees it with the sandbox's mount namespace. crun 1.8.1 creates no device node or
 * /dev symlink in a /dev that is a bind (linux.c, mount_dev_from_host), so this makes
 * the ones its create_missing_devs() makes in a /dev tmpfs, with the same modes. They
 * work inside because crun's default device cgroup rules allow them, as before; the
 * sandbox cannot add others (no CAP_MKNOD, every other device denied). Pages written
 * later are charged to the writer's memory cgroup (the sandbox's), as with any tmpfs;
 * only these few inodes are charged to the wrapper's. */
static const struct {
	const char *name;
	unsigned int major, minor;
} dev_nodes[] = {
	{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"tty", 5, 0}, {"random", 1, 8}, {"urandom", 1, 9},
};
static const struct {
	const char *name, *target;
} dev_links[] = {
	{"fd", "/proc/self/fd"}, {"stdin", "/proc/self/fd/0"}, {"stdout", "/proc/self/fd/1"},
	{"stderr", "/proc/self/fd/2"}, {"core", "/proc/kcore"}, {"ptmx", "pts/ptmx"},
};

static int dev_tmpfs(const char *dir, const char *data)
{
	if (mount("tmpfs", dir, "tmpfs", MS_NOSUID | MS_STRICTATIME, data) < 0) {
		dprintf(2, "dsec-init crun-wrap: mount tmpfs on %s: %s\n", dir, strerror(errno));
		return -1;
	}
	int fd = open(dir, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		dprintf(2, "dsec-init crun-wrap: open %s: %s\n", dir, strerror(errno));
		return -1;
	}
	mode_t old = umask(0); /* the modes below exactly, whatever the caller's umask */
	const char *what = "shm";
	int rc = mkdirat(fd, "shm", 01777);
	for (size_t k = 0; rc == 0 && k < sizeof(dev_nodes) / sizeof(dev_nodes[0]); k++) {
		what = dev_nodes[k].name;
		rc = mknodat(fd, what, S_IFCHR | 0666, makedev(dev_nodes[k].major, dev_nodes[k].minor));
	}
	for (size_t k = 0; rc == 0 && k < sizeof(dev_links) / sizeof(dev_links[0]); k++) {
		what = dev_links[k].name;
		rc = symlinkat(dev_links[k].target, fd, what);
	}
	int saved = errno;
	umask(old);
	close(fd);
	if (rc < 0) {
		dprintf(2, "dsec-init crun-wrap: create %s/%s: %s\n", dir, what, strerror(saved));
		return -1;
	}
	return 0;
}

/* Move every hierarchy named by a directory in VIEW from /sys/fs/cgroup into VIEW, then
 * VIEW over /sys/fs/cgroup (in a private mount namespace: nothing changes on the host). */
static int cgroup_view(const char *view)
{
	DIR *dir = opendir(view);
	if (!dir) {
		dprintf(2, "dsec-init crun-wrap: %s: %s\n", view, strerror(errno));
		return -1;
	}
	struct dirent *e;
	while ((e = readdir(dir)) != NULL) {
		if (e->d_type != DT_DIR || e->d_name[0] == '.')
			continue; /* symlinks (co-mounted aliases) need no mount of their own */
		char from[PATH_MAX], to[PATH_MAX];
		snprintf(from, sizeof from, "/sys/fs/cgroup/%s", e->d_name);
		snprintf(to, sizeof to, "%s/%s", view, e->d_name);
		if (mount(from, to, NULL, MS_MOVE, NULL) < 0) {
			dprintf(2, "dsec-init crun-wrap: move %s to %s: %s\n", from, to, strerror(errno));
			closedir(dir);
			return -1;
		}
	}
	closedir(dir);
	if (mount(view, "/sys/fs/cgroup", NULL, MS_MOVE, NULL) < 0) {
		dprintf(2, "dsec-init crun-wrap: move %s to /sys/fs/cgroup: %s\n", view, strerror(errno));
		return -1;
	}
	return 0;
}

/* Write this process into DIR/cgroup.procs. */
static int cgroup_park(const char *dir)
{
	char path[PATH_MAX], pid[24];
	snprintf(path, sizeof path, "%s/cgroup.procs", dir);
	int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
	int fd = open(path, O_WRONLY | O_CLOEXEC);
	if (fd < 0 || write(fd, pid, (size_t)n) != n) {
		dprintf(2, "dsec-init crun-wrap: join %s: %s\n", path, strerror(errno));
		if (fd >= 0)
			close(fd);
		return -1;
	}
	close(fd);
	return 0;
}

static int crun_wrap(int argc, char **argv)
{
	static const char target[] = "/sys/fs/cgroup/unified/cgroup.controllers";
	const char *mask = NULL, *ovl_target = NULL, *ovl_data = NULL;
	const char *dev_dir = NULL, *dev_data = NULL, *view = NULL;
	int fd = -1, i = 2, keyring = 0;
	if (argc >= 3 && strncmp(argv[2], "--", 2) != 0) {
		mask = argv[2]; /* positional form */
		i = 3;
	} else {
		for (; i < argc && strcmp(argv[i], "--") != 0; i += 2) {
			if (i + 1 >= argc)
				goto usage;
			if (strcmp(argv[i], "--fd") == 0)
				fd = atoi(argv[i + 1]);
			else if (strcmp(argv[i], "--mask-cgroup2") == 0)
				mask = argv[i + 1];
			else if (strcmp(argv[i], "--overlay-target") == 0)
				ovl_target = argv[i + 1];
			else if (strcmp(argv[i], "--overlay-data") == 0)
				ovl_data = argv[i + 1];
			else if (strcmp(argv[i], "--dev-tmpfs") == 0)
				dev_dir = argv[i + 1];
			else if (strcmp(argv[i], "--dev-data") == 0)
				dev_data = argv[i + 1];
			else if (strcmp(argv[i], "--cgroup-view") == 0)
				view = argv[i + 1];
			else if (strcmp(argv[i], "--session-keyring") == 0 && strcmp(argv[i + 1], "new") == 0)
				keyring = 1;
			else if (strcmp(argv[i], "--cgroup-park") == 0) {
				if (cgroup_park(argv[i + 1]) < 0)
					return 125;
			} else
				goto usage;
		}
		i++; /* skip "--" */
	}
	if (i >= argc || (ovl_target == NULL) != (ovl_data == NULL) ||
	    (dev_dir == NULL) != (dev_data == NULL))
		goto usage;
	if (fd >= 0 && fd != 3) {
		if (dup2(fd, 3) < 0) {
			dprintf(2, "dsec-init crun-wrap: fd %d: %s\n", fd, strerror(errno));
			return 125;
		}
		close(fd);
	}
	if (mask || ovl_target || dev_dir || view) {
		struct stat st;
		if (mask && stat(mask, &st) < 0) {
			dprintf(2, "dsec-init crun-wrap: %s: %s\n", mask, strerror(errno));
			return 125;
		}
		if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
			dprintf(2, "dsec-init crun-wrap: private mount namespace: %s\n", strerror(errno));
			return 125;
		}
	}
	char *by_fd = ovl_target ? overlay_by_fd(ovl_data) : NULL;
	if (ovl_target && mount("overlay", ovl_target, "overlay", MS_NODEV, by_fd ? by_fd : ovl_data) < 0) {
		dprintf(2, "dsec-init crun-wrap: mount overlay on %s: %s\n", ovl_target, strerror(errno));
		return 125;
	}
	if (dev_dir && dev_tmpfs(dev_dir, dev_data) < 0)
		return 125;
	if (view && cgroup_view(view) < 0)
		return 125;
	if (mask) {
		if (mount(mask, target, NULL, MS_BIND, NULL) < 0 && errno != ENOENT) {
			dprintf(2, "dsec-init crun-wrap: bind %s over %s: %s\n", mask, target, strerror(errno));
			return 125;
		}
	}
	/* ENOSYS: a kernel without keys, where crun makes no keyring either. */
	if (keyring && syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, (char *)NULL) < 0 &&
	    errno != ENOSYS) {
		dprintf(2, "dsec-init crun-wrap: new session keyring: %s\n", strerror(errno));
		return 125;
	}
	execv(argv[i], argv + i);
	dprintf(2, "dsec-init crun-wrap: cannot execute %s: %s\n", argv[i], strerror(errno));
	return 127;
usage:
	dprintf(2, "usage: %s crun-wrap EMPTY_FILE CRUN_PATH [ARGS...]\n"
		   "       %s crun-wrap [--fd N] [--mask-cgroup2 EMPTY_FILE] [--overlay-target DIR\n"
		   "                 --overlay-data OPTS] [--dev-tmpfs DIR --dev-data OPTS]\n"
		   "                 [--cgroup-view DIR] [--cgroup-park DIR]... -- CRUN_PATH [ARGS...]\n",
		argv[0], argv[0]);
	return 125;
}

/* ---- spawner mode --------------------------------------------------------------- */
/* `dsec-init spawner SOCKET` starts processes for the platform and reaps them. It is a */
/* subreaper, so crun's intermediate processes and every container's init end up as its */
/* children; it outlives the platform (setsid, no parent-death signal), so after a      */
/* platform crash the adopted sandboxes' inits still have a parent that reaps them      */
/* (this host's pid 1 does not). Protocol, one request per SOCK_SEQPACKET connection:   */
/*   request: u32 op, i32 extra_target, u32 argc, u32 envc, then argc + envc strings,   */
/*            each NUL-terminated; SCM_RIGHTS carries stdout, stderr[, extra fd].       */
/*   replies: i32 kind, i32 value: PID (pid, or -errno if it could not start), later    */
/*            EXIT (raw wait status). op SHUTDOWN is answered with BYE; we then stop    */
/*            listening and exit once every child of ours is reaped (sp_drain).         */
/* op STATUS (extra_target = a pid, no strings or fds) is answered with EXIT and the    */
/* wait status of that pid if it is among the last SP_RING orphans we reaped, else with */
/* UNKNOWN: how the platform learns how a sandbox's init died without holding a pidfd */
/* per sandbox (an init is our orphan, not the platform's child).                     */
/* Mirrored in src/dsec/spawn.py. A client that goes away only loses its replies: the   */
/* child runs on and is reaped like any orphan.                                         */

enum { SP_OP_RUN = 1, SP_OP_SHUTDOWN = 2, SP_OP_STATUS = 3 };
enum { SP_PID = 1, SP_EXIT = 2, SP_BYE = 3, SP_UNKNOWN = 4 };
#define SP_RING 1024

/* The wait statuses of the last SP_RING orphans reaped (no client waited for them). */
static struct {
	pid_t pid;
	int status;
} sp_ring[SP_RING];
static size_t sp_ring_next;
#define SP_MAX_MSG (256 * 1024)
#define SP_MAX_FDS 3

struct sp_client {
	int fd;
	pid_t pid; /* 0 until its request started a child */
};

static struct sp_client *sp_clients;
static size_t sp_count, sp_cap;

static void sp_reply(int fd, int32_t kind, int32_t value)
{
	int32_t msg[2] = {kind, value};
	/* 8 bytes on an otherwise idle socket: never blocks; a gone client is fine. */
	if (send(fd, msg, sizeof msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 && errno != EPIPE &&
	    errno != ECONNRESET)
		dprintf(2, "dsec-init spawner: reply: %s\n", strerror(errno));
}

static void sp_drop(size_t i)
{
	close(sp_clients[i].fd);
	sp_clients[i] = sp_clients[--sp_count];
}

/* Parse `count` NUL-terminated strings from buf[*off..len) into a NULL-ended array. */
static char **sp_strings(char *buf, size_t len, size_t *off, uint32_t count)
{
	if (count > len - *off)
		return NULL;
	char **v = calloc((size_t)count + 1, sizeof *v);
	if (v == NULL)
		return NULL;
	for (uint32_t k = 0; k < count; k++) {
		char *end = memchr(buf + *off, 0, len - *off);
		if (end == NULL) {
			free(v);
			return NULL;
		}
		v[k] = buf + *off;
		*off = (size_t)(end - buf) + 1;
	}
	return v;
}

/* What the spawner ignores or takes by signalfd (blocked): a child gets the default    */
/* disposition of each, whichever way it is started (sp_start_wrap, sp_start).          */
static const int sp_child_default_signals[] = {SIGHUP, SIGINT, SIGPIPE, SIGCHLD};
#define SP_CHILD_DEFAULT_SIGNALS (sizeof sp_child_default_signals / sizeof sp_child_default_signals[0])

/* Our own executable (dev, ino), for sp_start_wrap: 0/0 when unknown. */
static dev_t sp_self_dev;
static ino_t sp_self_ino;

/* Whether `path` is this very binary (same file, not just the same name: a platform   */
/* that upgraded the agent names another file, and that one's crun-wrap must run).     */
static int sp_is_self(const char *path)
{
	struct stat st;
	return sp_self_ino != 0 && stat(path, &st) == 0 && st.st_dev == sp_self_dev &&
	       st.st_ino == sp_self_ino;
}

/* A `crun-wrap` request for this binary (every runtime call of a container create):    */
/* fork and run crun_wrap() in the child, which then execs crun, instead of spawning a  */
/* second copy of this binary that would do the same. Saves an exec of the agent per   */
/* create (its mapping, page faults and libc start: ~0.2 ms on the create path). The    */
/* child gets what sp_start's spawn attributes give: default signal dispositions for    */
/* what we ignore or take by signalfd, an empty mask, 0 = /dev/null, 1 and 2 and the    */
/* target fd from the request, the request's environment. It never returns into the   */
/* spawner's loop: crun_wrap() execs or fails, and the child exits with its status.    */
static pid_t sp_start_wrap(char **argv, char **envp, const int *fds, int nfds, int target, int *err)
{
	pid_t pid = fork();
	if (pid != 0) {
		*err = pid < 0 ? errno : 0;
		return pid;
	}
	sigset_t none;
	sigemptyset(&none);
	for (size_t k = 0; k < SP_CHILD_DEFAULT_SIGNALS; k++)
		signal(sp_child_default_signals[k], SIG_DFL);
	sigprocmask(SIG_SETMASK, &none, NULL);
	/* Not O_CLOEXEC: it may itself be fd 0 (a spawner started with 0 closed). */
	int null = open("/dev/null", O_RDONLY);
	if (null < 0 || (null != 0 && dup2(null, 0) < 0))
		_exit(127);
	if (null > 2)
		close(null);
	if (dup2(fds[0], 1) < 0 || dup2(fds[1], 2) < 0 || (nfds == 3 && dup2(fds[2], target) < 0))
		_exit(127);
	environ = envp;
	int argc = 0;
	while (argv[argc] != NULL)
		argc++;
	_exit(crun_wrap(argc, argv));
}

static pid_t sp_start(char **argv, char **envp, const int *fds, int nfds, int target, int *err)
{
	if (argv[1] != NULL && strcmp(argv[1], "crun-wrap") == 0 && sp_is_self(argv[0]))
		return sp_start_wrap(argv, envp, fds, nfds, target, err);
	posix_spawn_file_actions_t fa;
	posix_spawnattr_t attr;
	sigset_t none, dfl;
	pid_t pid = 0;
	sigemptyset(&none);
	sigemptyset(&dfl);
	/* What we ignore or block is inherited across exec: give the child the defaults. */
	for (size_t k = 0; k < SP_CHILD_DEFAULT_SIGNALS; k++)
		sigaddset(&dfl, sp_child_default_signals[k]);
	posix_spawn_file_actions_init(&fa);
	posix_spawnattr_init(&attr);
	/* Our fds are all close-on-exec, so the child gets exactly 0, 1, 2 (and target). */
	posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
	posix_spawn_file_actions_adddup2(&fa, fds[0], 1);
	posix_spawn_file_actions_adddup2(&fa, fds[1], 2);
	if (nfds == 3)
		posix_spawn_file_actions_adddup2(&fa, fds[2], target);
	posix_spawnattr_setsigmask(&attr, &none);
	posix_spawnattr_setsigdefault(&attr, &dfl);
	posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
	*err = posix_spawn(&pid, argv[0], &fa, &attr, argv, envp);
	posix_spawn_file_actions_destroy(&fa);
	posix_spawnattr_destroy(&attr);
	return *err ? -1 : pid;
}

static void sp_reap_pid(pid_t pid);
static int sp_ring_find(pid_t pid, int *status);

/* Handle one readable client; returns 1 when asked to shut down. */
static int sp_request(size_t i)
{
	static char buf[SP_MAX_MSG];
	union {
		struct cmsghdr align;
		char space[CMSG_SPACE(sizeof(int) * SP_MAX_FDS)];
	} ctl;
	struct iovec iov = {buf, sizeof buf};
	struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space,
			    .msg_controllen = sizeof ctl.space};
	int fds[SP_MAX_FDS], nfds = 0, quit = 0;
	ssize_t n = recvmsg(sp_clients[i].fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return 0;
	for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); n >= 0 && c; c = CMSG_NXTHDR(&mh, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		int *in = (int *)(void *)CMSG_DATA(c);
		for (size_t j = 0; j < k; j++) {
			if (nfds < SP_MAX_FDS)
				fds[nfds++] = in[j];
			else
				close(in[j]);
		}
	}
	if (n <= 0 || sp_clients[i].pid != 0) {
		/* Gone (its child, if any, runs on), or a second request: not ours to serve. */
		for (int j = 0; j < nfds; j++)
			close(fds[j]);
		sp_drop(i);
		return 0;
	}
	struct {
		uint32_t op;
		int32_t target;
		uint32_t argc, envc;
	} hdr;
	char **argv = NULL, **envp = NULL;
	int err = EINVAL;
	pid_t pid = -1;
	size_t off = sizeof hdr;
	if ((size_t)n < sizeof hdr || (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)))
		goto bad;
	memcpy(&hdr, buf, sizeof hdr);
	if (hdr.op == SP_OP_SHUTDOWN) {
		sp_reply(sp_clients[i].fd, SP_BYE, 0);
		quit = 1;
		goto bad;
	}
	if (hdr.op == SP_OP_STATUS) {
		int status = 0;
		sp_reap_pid(hdr.target); /* exited but its SIGCHLD merged: reap it now */
		if (sp_ring_find(hdr.target, &status) == 0)
			sp_reply(sp_clients[i].fd, SP_EXIT, status);
		else
			sp_reply(sp_clients[i].fd, SP_UNKNOWN, 0);
		for (int j = 0; j < nfds; j++)
			close(fds[j]);
		sp_drop(i);
		return 0;
	}
	if (hdr.op != SP_OP_RUN || hdr.argc == 0 || nfds != (hdr.target >= 0 ? 3 : 2) ||
	    (hdr.target >= 0 && hdr.target < 3))
		goto bad;
	argv = sp_strings(buf, (size_t)n, &off, hdr.argc);
	envp = argv ? sp_strings(buf, (size_t)n, &off, hdr.envc) : NULL;
	if (envp != NULL)
		pid = sp_start(argv, envp, fds, nfds, hdr.target, &err);
bad:
	free(argv);
	free(envp);
	for (int j = 0; j < nfds; j++)
		close(fds[j]);
	if (quit)
		return 1;
	if (pid < 0) {
		sp_reply(sp_clients[i].fd, SP_PID, -err);
		sp_drop(i);
		return 0;
	}
	sp_clients[i].pid = pid;
	sp_reply(sp_clients[i].fd, SP_PID, pid);
	return 0;
}

/* Reaping is O(1) per death, not O(children): every sandbox's init is our child (we  */
/* adopt them as subreaper), and the kernel answers waitpid(-1) by walking all of our */
/* children: measured 0.39 ms a call at 3,000 children (0.6 us at 10), and a reap     */
/* pass makes one call per zombie plus one, so at 10,000 sandboxes every create and   */
/* delete paid milliseconds here, serialising the spawns behind it. waitpid(pid) looks */
/* at one child. So a SIGCHLD's own pid (signalfd's ssi_pid) and the pids clients wait */
/* for are reaped by pid; and since SIGCHLDs that arrive while one is pending merge   */
/* into it, a full pass (sp_reap_all) still runs, but at most every SP_SWEEP_MS after */
/* a SIGCHLD, not on every one: a death whose signal merged is reaped within it.       */
#define SP_SWEEP_MS 200

static void sp_reaped(pid_t pid, int status)
{
	for (size_t i = 0; i < sp_count; i++) {
		if (sp_clients[i].pid == pid) {
			sp_reply(sp_clients[i].fd, SP_EXIT, status);
			sp_drop(i);
			return;
		}
	}
	sp_ring[sp_ring_next].pid = pid;
	sp_ring[sp_ring_next].status = status;
	sp_ring_next = (sp_ring_next + 1) % SP_RING;
}

/* The newest ring entry of `pid`: -1 when there is none. */
static int sp_ring_find(pid_t pid, int *status)
{
	for (size_t k = 1; k <= SP_RING; k++) {
		size_t j = (sp_ring_next + SP_RING - k) % SP_RING;
		if (sp_ring[j].pid == pid && pid > 0) {
			*status = sp_ring[j].status;
			return 0;
		}
	}
	return -1;
}

static void sp_reap_pid(pid_t pid)
{
	int status;
	if (pid > 0 && waitpid(pid, &status, WNOHANG) == pid)
		sp_reaped(pid, status);
}

/* The SIGCHLD's child and the children clients wait for (a handful in flight). */
static void sp_reap_known(pid_t hint)
{
	sp_reap_pid(hint);
	/* From the back: sp_drop() moves the last client into the freed slot. */
	for (size_t i = sp_count; i-- > 0;)
		if (i < sp_count && sp_clients[i].pid > 0)
			sp_reap_pid(sp_clients[i].pid);
}

/* Reap every exited child (the sweep for merged SIGCHLDs). */
static void sp_reap_all(void)
{
	int status;
	pid_t pid;
	while ((pid = waitpid(-1, &status, WNOHANG)) > 0)
		sp_reaped(pid, status);
}

/* After SHUTDOWN: reap every child, waiting for the ones still alive, before exiting. */
/* The platform asks for a shutdown right after it stopped its sandboxes, so their inits */
/* (our children as subreaper) may be dying, or dead with their SIGCHLD merged and the  */
/* sweep not due yet. Exiting then would hand each to pid 1, which on this host never   */
/* reaps: a zombie init for good, one per sandbox. A child that lives on keeps us as    */
/* its reaping parent, which is our job; the socket is gone, so no new work comes.      */
static void sp_drain(void)
{
	/* A client whose request was not read will get none: EOF now, not when we exit. */
	for (size_t i = sp_count; i-- > 0;)
		if (i < sp_count && sp_clients[i].pid == 0)
			sp_drop(i);
	for (;;) {
		int status;
		pid_t pid = waitpid(-1, &status, 0);
		if (pid > 0)
			sp_reaped(pid, status);
		else if (errno != EINTR)
			return; /* ECHILD: nothing left to reap */
	}
}

static long long sp_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int spawner_main(int argc, char **argv)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	struct stat ours;
	struct rlimit rl;
	sigset_t chld;
	if (argc != 3 || strlen(argv[2]) >= sizeof sa.sun_path) {
		dprintf(2, "usage: %s spawner SOCKET_PATH\n", argv[0]);
		return 2;
	}
	const char *path = argv[2];
	memcpy(sa.sun_path, path, strlen(path) + 1);
	/* Whatever fds the platform let us inherit would reach every child: drop them. */
	close_from(3);
	setsid(); /* our own session: no terminal or process-group signal of the platform's */
	prctl(PR_SET_CHILD_SUBREAPER, 1);
	signal(SIGPIPE, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
	signal(SIGINT, SIG_IGN);
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max;
		setrlimit(RLIMIT_NOFILE, &rl);
	}
	sigemptyset(&chld);
	sigaddset(&chld, SIGCHLD);
	sigprocmask(SIG_BLOCK, &chld, NULL);
	int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
	int lfd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	umask(077);
	unlink(path);
	if (sfd < 0 || lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof sa) < 0 ||
	    chmod(path, 0600) < 0 || stat(path, &ours) < 0 || listen(lfd, 1024) < 0) {
		dprintf(2, "dsec-init spawner: %s: %s\n", path, strerror(errno));
		return 1;
	}
	if (chdir("/") < 0)
		return 1;
	struct stat self;
	if (stat("/proc/self/exe", &self) == 0) {
		sp_self_dev = self.st_dev;
		sp_self_ino = self.st_ino;
	}
	struct pollfd *pfd = NULL;
	size_t pcap = 0;
	long long sweep_at = -1; /* when the next full reap pass is due (-1: none) */
	for (;;) {
		if (pcap < sp_count + 2) {
			pcap = (sp_count + 2) * 2;
			pfd = realloc(pfd, pcap * sizeof *pfd);
			if (pfd == NULL)
				return 1;
		}
		pfd[0] = (struct pollfd){.fd = lfd, .events = POLLIN};
		pfd[1] = (struct pollfd){.fd = sfd, .events = POLLIN};
		size_t polled = sp_count;
		for (size_t i = 0; i < polled; i++)
			pfd[i + 2] = (struct pollfd){.fd = sp_clients[i].fd, .events = POLLIN};
		int wait_ms = -1;
		if (sweep_at >= 0) {
			long long left = sweep_at - sp_now_ms();
			wait_ms = left > 0 ? (int)left : 0;
		}
		int ready = poll(pfd, polled + 2, wait_ms);
		if (ready < 0) {
			if (errno == EINTR)
				continue;
			return 1;
		}
		if (pfd[1].revents) {
			struct signalfd_siginfo si;
			while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si)
				sp_reap_known((pid_t)si.ssi_pid);
			if (sweep_at < 0)
				sweep_at = sp_now_ms() + SP_SWEEP_MS;
		}
		if (sweep_at >= 0 && sp_now_ms() >= sweep_at) {
			sp_reap_all();
			sweep_at = -1;
		}
		if (ready == 0)
			continue;
		/* Clients from the back: sp_drop() moves the last one into a freed slot. */
		for (size_t i = polled; i-- > 0;) {
			if (!pfd[i + 2].revents || i >= sp_count || sp_clients[i].fd != pfd[i + 2].fd)
				continue;
			if (sp_request(i)) {
				struct stat now;
				if (stat(path, &now) == 0 && now.st_ino == ours.st_ino &&
				    now.st_dev == ours.st_dev)
					unlink(path);
				close(lfd);
				sp_drain();
				return 0;
			}
		}
		if (pfd[0].revents) {
			for (;;) {
				int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
				if (c < 0)
					break;
				if (sp_count == sp_cap) {
					size_t cap = sp_cap ? sp_cap * 2 : 64;
					struct sp_client *grown = realloc(sp_clients, cap * sizeof *grown);
					if (grown == NULL) {
						close(c);
						break;
					}
					sp_clients = grown;
					sp_cap = cap;
				}
				sp_clients[sp_count++] = (struct sp_client){.fd = c, .pid = 0};
			}
		}
	}
}

int main(int argc, char **argv)
{
	if (argc >= 2 && strcmp(argv[1], "crun-wrap") == 0)
		return crun_wrap(argc, argv);
	if (argc >= 2 && strcmp(argv[1], "spawner") == 0)
		return spawner_main(argc, argv);
	return agent_main();
}
