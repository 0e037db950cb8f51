/* dsec-zygote: builds FnCall sandboxes ahead of demand and runs one call in each.
 *
 * One zygote per warm pool. It is started by the platform with a config file and a
 * SOCK_SEQPACKET socket on fd 3. Commands (text, one per datagram):
 *   "S <n>"   build n more sandboxes
 *   "K <id>"  kill sandbox <id> (its pid 1; the kernel kills the rest of its pid ns)
 *   "Q"       kill every sandbox, remove their cgroups, exit
 *   "P <0|1>" with "idle 1": build at normal priority (1, someone waits) or idle (0)
 * Replies: "R <id> <cgroup-name> <pid> <baseline memory charge>" with the sandbox's
 * control socket attached
 * (SCM_RIGHTS), "D <id>" when a sandbox is gone and its cgroups removed, "E <msg>".
 *
 * With "idle 1" sandboxes are built at SCHED_IDLE (the zygote's policy, inherited by
 * its clones): building the next sandbox is background work that a call in progress
 * preempts at once, whatever CPU it lands on. Measured on a 2-core host: a bash call
 * right after another one took ~2x as long while its predecessor's replacement was
 * built at normal priority. The platform switches a runner to SCHED_OTHER when a call
 * takes it (the runner then does the same for its pre-started step; steps it forks
 * inherit its policy), and sends "P 1" while a call or a warm-up waits for a sandbox,
 * so other load on the host can delay building only while nobody waits for it.
 *
 * A sandbox is a process cloned into fresh pid, mount, net, ipc and uts namespaces
 * and put into its cgroups before it touches anything. It mounts a private tmpfs
 * (memory-charged, sized to the memory limit) for /tmp, binds the image's root over
 * it read-only (the layer's shared EROFS mount, or for several layers one read-only
 * overlay the zygote mounts once in its own mount namespace), adds proc and a minimal
 * /dev, pivots into it and then waits on its control socket. Why a shared read-only
 * root and not a writable overlay per sandbox: calls run as an unprivileged user, who
 * could only write /tmp anyway, and a fresh overlay starts with cold dentry/inode
 * caches, so every first exec paid for lookups again (rootmode 0 keeps the overlay
 * variant, for images that need a writable root). Pristine by construction: the
 * tmpfs and the namespaces die with the sandbox's pid 1.
 *
 * Its pid 1 (this code, "the runner") executes steps: each step is forked, gets
 * rlimits, drops every capability and its uid, sets no_new_privs and Landlock scoping
 * and execs, under the platform's seccomp filter (compiled once by the zygote with
 * libseccomp, attached to pid 1 when the sandbox is built, inherited by every step). Wall and CPU limits
 * are kernel timers (a poll timeout and a POSIX timer on the step's CPU clock), not
 * polling; overruns kill the whole sandbox process tree with kill(-1) from pid 1.
 * Emptied cgroups are reused by later sandboxes (`reuse`), so a call costs no cgroup
 * mkdir/rmdir and leaves no dying memory cgroups behind.
 * With "prestart_*" lines (languages marked prestart), each sandbox also starts the
 * pool's run step ahead of its call and the interpreter waits on a FIFO for the program
 * (see prestart()).
 *
 * Runner protocol on the control socket (stream; little-endian u32 header tag|len):
 *   'F' file:  u32 mode, path NUL, data          (no reply)
 *   'X' exec:  u32 cpu_ms, wall_ms, out_limit, nargs, nenv, stdin_len,
 *              then nargs+nenv NUL-terminated strings, then stdin bytes
 *        -> 'r': i32 exit, i32 signal, u32 flags, u32 err, u64 wall_us, u64 cpu_us,
 *              u32 out_len, u32 err_len, stdout, stderr
 *   'G' get:   path, u32 max  -> 'g': u32 found, data
 *   'Q' quit   (pid 1 exits: the sandbox is destroyed)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <seccomp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>

#define MAX_LOWER 64
#define MAX_CG 8
#define MAX_SET 32
#define MAX_SB 4096
#define CTL_FD 3
#define WORKDIR "/tmp/work"

#define F_WALL 1u
#define F_CPU 2u
#define F_OUTPUT 4u
#define F_EXECFAIL 8u

struct cgset { int cg; char file[64]; char value[64]; };

static char lowers[MAX_LOWER][PATH_MAX];
static int nlowers;
static char stage[PATH_MAX];
static char rootmnt[PATH_MAX];
static char shared[PATH_MAX];
static const char *shared_root;
static int rootmode = 1; /* 0: writable overlay per sandbox, 1: shared read-only root */
static char cgdirs[MAX_CG][PATH_MAX];
static int ncg;
static struct cgset sets[MAX_SET], ends[MAX_SET], resets[MAX_SET];
static int nsets, nends, nresets;
/* Emptied cgroups kept for the next sandbox (no mkdir/rmdir per call, and no dying
 * memory cgroups piling up): up to `reuse` of them, reset with the cgreset lines.
 * Oldest first, so that the kernel is done tearing the last sandbox down (its tmpfs is
 * freed by deferred work after pid 1 is reaped). What a slot still has charged then is
 * page cache of image files its sandboxes read first (shared, reclaimable): reclaimed
 * ("cgreclaim") only past a threshold, since memory.force_empty walks every shrinker
 * and retries (measured: ~3-4 ms of CPU per sandbox when written on every reuse, the
 * largest single cost of a call), and reported with each sandbox so that its peak
 * memory counts only its own. */
static int reuse;
static int free_slots[MAX_SB];
static int nfree;
static int reclaim_cg = -1; /* "cgreclaim <cg> <usage file> <reclaim file> <bytes>" */
static char reclaim_usage[64], reclaim_file[64];
static unsigned long long reclaim_over;
static int next_slot;
static unsigned long long tmpfs_bytes = 64ull << 20;
static unsigned uid = 65534;
static int newnet = 1;
static int idle_build; /* config "idle": build sandboxes at SCHED_IDLE (see the top) */
/* config "oom_score_adj": every sandbox's bias for the OOM killer (dsec.resources.oom),
 * written before it runs, so its runner and every step inherit it (and, written with
 * CAP_SYS_RESOURCE, cannot go below it). The zygote itself keeps its own. */
static char oom_adj[16];
static struct sock_fprog filter;
static int have_filter;
/* A pre-started step (config "prestart_*"): see prestart() below. */
#define MAX_PRE 64
static char pre_src[256];
static char *pre_argv[MAX_PRE + 1], *pre_env[MAX_PRE + 1];
static int pre_nargs, pre_nenv;
static uint32_t pre_cpu_ms = 10000;

struct sandbox { int id; int slot; pid_t pid; };
static struct sandbox sbs[MAX_SB];
static int nsb;
static int next_id;

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "dsec-zygote: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, ": %s\n", strerror(errno));
    va_end(ap);
    _exit(111);
}

static int write_file(const char *path, const char *value) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, value, strlen(value));
    int saved = errno;
    close(fd);
    errno = saved;
    return n < 0 ? -1 : 0;
}

/* ---- config ------------------------------------------------------------------- */

static int seccomp_op(const char *op) {
    if (!strcmp(op, "SCMP_CMP_EQ")) return SCMP_CMP_EQ;
    if (!strcmp(op, "SCMP_CMP_NE")) return SCMP_CMP_NE;
    if (!strcmp(op, "SCMP_CMP_MASKED_EQ")) return SCMP_CMP_MASKED_EQ;
    if (!strcmp(op, "SCMP_CMP_LT")) return SCMP_CMP_LT;
    if (!strcmp(op, "SCMP_CMP_LE")) return SCMP_CMP_LE;
    if (!strcmp(op, "SCMP_CMP_GT")) return SCMP_CMP_GT;
    if (!strcmp(op, "SCMP_CMP_GE")) return SCMP_CMP_GE;
    return -1;
}

/* Rules file lines: "default <errno>" then "<errno|allow> <name> [<idx> <op> <v> <v2>]..."
 * (errno -1 = allow). Compiled once; forked runners inherit the BPF program. */
static void load_seccomp(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) die("open %s", path);
    char line[4096];
    scmp_filter_ctx ctx = NULL;
    while (fgets(line, sizeof line, f)) {
        char *save = NULL, *tok = strtok_r(line, " \n", &save);
        if (!tok) continue;
        if (!strcmp(tok, "default")) {
            int e = atoi(strtok_r(NULL, " \n", &save));
            ctx = seccomp_init(SCMP_ACT_ERRNO(e));
            if (!ctx) die("seccomp_init");
            continue;
        }
        if (!ctx) die("seccomp rules without default");
        int e = atoi(tok);
        char *name = strtok_r(NULL, " \n", &save);
        int nr = seccomp_syscall_resolve_name(name);
        if (nr == __NR_SCMP_ERROR) continue; /* not on this architecture */
        struct scmp_arg_cmp args[6];
        unsigned na = 0;
        char *idx;
        while ((idx = strtok_r(NULL, " \n", &save)) && na < 6) {
            char *op = strtok_r(NULL, " \n", &save);
            char *v = strtok_r(NULL, " \n", &save);
            char *v2 = strtok_r(NULL, " \n", &save);
            if (!op || !v || !v2 || seccomp_op(op) < 0) die("bad seccomp rule for %s", name);
            args[na].arg = (unsigned)atoi(idx);
            args[na].op = (enum scmp_compare)seccomp_op(op);
            args[na].datum_a = strtoull(v, NULL, 0);
            args[na].datum_b = strtoull(v2, NULL, 0);
            na++;
        }
        uint32_t action = e < 0 ? SCMP_ACT_ALLOW : SCMP_ACT_ERRNO((uint32_t)e);
        int rc = seccomp_rule_add_array(ctx, action, nr, na, args);
        if (rc < 0 && rc != -EEXIST && rc != -EACCES) { /* EACCES: same as default */
            errno = -rc;
            die("seccomp rule %s", name);
        }
    }
    fclose(f);
    if (!ctx) die("empty seccomp rules");
    int mfd = memfd_create("bpf", MFD_CLOEXEC);
    if (mfd < 0 || seccomp_export_bpf(ctx, mfd) < 0) die("seccomp_export_bpf");
    off_t size = lseek(mfd, 0, SEEK_END);
    filter.len = (unsigned short)(size / (off_t)sizeof(struct sock_filter));
    filter.filter = malloc((size_t)size);
    if (!filter.filter || pread(mfd, filter.filter, (size_t)size, 0) != size) die("read bpf");
    close(mfd);
    seccomp_release(ctx);
    have_filter = 1;
}

static void load_config(const char *path) {
    FILE *f = fopen(path, "re");
    if (!f) die("open %s", path);
    char line[PATH_MAX + 128];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        char *val = strchr(line, ' ');
        if (!val) continue;
        *val++ = 0;
        if (!strcmp(line, "lower") && nlowers < MAX_LOWER) {
            snprintf(lowers[nlowers++], PATH_MAX, "%s", val);
        } else if (!strcmp(line, "rootmnt")) {
            snprintf(rootmnt, sizeof rootmnt, "%s", val);
        } else if (!strcmp(line, "shared")) {
            snprintf(shared, sizeof shared, "%s", val);
        } else if (!strcmp(line, "rootmode")) {
            rootmode = atoi(val);
        } else if (!strcmp(line, "stage")) {
            snprintf(stage, sizeof stage, "%s", val);
        } else if (!strcmp(line, "tmpfs_bytes")) {
            tmpfs_bytes = strtoull(val, NULL, 10);
        } else if (!strcmp(line, "uid")) {
            uid = (unsigned)strtoul(val, NULL, 10);
        } else if (!strcmp(line, "newnet")) {
            newnet = atoi(val);
        } else if (!strcmp(line, "idle")) {
            idle_build = atoi(val);
        } else if (!strcmp(line, "oom_score_adj")) {
            snprintf(oom_adj, sizeof oom_adj, "%d", atoi(val));
        } else if (!strcmp(line, "cg") && ncg < MAX_CG) {
            snprintf(cgdirs[ncg++], PATH_MAX, "%s", val);
        } else if (!strcmp(line, "reuse")) {
            reuse = atoi(val);
            if (reuse > MAX_SB) reuse = MAX_SB;
        } else if (!strcmp(line, "cgreclaim")) {
            if (sscanf(val, "%d %63s %63s %llu", &reclaim_cg, reclaim_usage, reclaim_file,
                       &reclaim_over) != 4)
                die("bad cgreclaim");
        } else if ((!strcmp(line, "cgset") && nsets < MAX_SET) ||
                   (!strcmp(line, "cgend") && nends < MAX_SET) ||
                   (!strcmp(line, "cgreset") && nresets < MAX_SET)) {
            struct cgset *s = !strcmp(line, "cgset")   ? &sets[nsets++]
                              : !strcmp(line, "cgend") ? &ends[nends++]
                                                       : &resets[nresets++];
            if (sscanf(val, "%d %63s %63s", &s->cg, s->file, s->value) != 3) die("bad %s", line);
        } else if (!strcmp(line, "seccomp")) {
            load_seccomp(val);
        } else if (!strcmp(line, "prestart_cpu_ms")) {
            pre_cpu_ms = (uint32_t)strtoul(val, NULL, 10);
        } else if (!strcmp(line, "prestart_src")) {
            snprintf(pre_src, sizeof pre_src, "%s", val);
        } else if (!strcmp(line, "prestart_arg") && pre_nargs < MAX_PRE) {
            pre_argv[pre_nargs++] = strdup(val);
        } else if (!strcmp(line, "prestart_env") && pre_nenv < MAX_PRE) {
            pre_env[pre_nenv++] = strdup(val);
        }
    }
    fclose(f);
    if (!nlowers || !stage[0] || !rootmnt[0] || (rootmode == 1 && nlowers > 1 && !shared[0])) {
        errno = EINVAL;
        die("config needs lower and stage");
    }
}

/* ---- runner (pid 1 of a sandbox) ---------------------------------------------- */

static int read_full(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t n = read(fd, p, len);
        if (n == 0) return -1;
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* One writev: the platform wakes once for the whole reply, not once per part. */
static void send_record(char tag, const void *a, size_t alen, const void *b, size_t blen,
                        const void *c, size_t clen) {
    uint32_t hdr[2] = {(uint32_t)tag, (uint32_t)(alen + blen + clen)};
    struct iovec iov[4] = {{hdr, sizeof hdr}, {(void *)a, alen}, {(void *)b, blen},
                           {(void *)c, clen}};
    struct iovec *v = iov;
    int n = 4;
    while (n) {
        ssize_t w = writev(CTL_FD, v, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            _exit(0);
        }
        while (n && (size_t)w >= v->iov_len) {
            w -= (ssize_t)v->iov_len;
            v++;
            n--;
        }
        if (n) {
            v->iov_base = (char *)v->iov_base + w;
            v->iov_len -= (size_t)w;
        }
    }
}

static void mkdirs(char *path, mode_t mode) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(path, mode) == 0) (void)chown(path, uid, uid);
        *p = '/';
    }
}

static int pre_file(const char *full, const char *data, size_t dlen, uint32_t mode);

static void do_file(char *payload, uint32_t len) {
    if (len < 5) return;
    uint32_t mode;
    memcpy(&mode, payload, 4);
    char *path = payload + 4;
    size_t plen = strnlen(path, len - 4);
    if (plen == len - 4) return;
    char *data = path + plen + 1;
    size_t dlen = len - 4 - plen - 1;
    char full[PATH_MAX];
    snprintf(full, sizeof full, "%s%s", path[0] == '/' ? "" : WORKDIR "/", path);
    if (pre_file(full, data, dlen, mode)) return;
    mkdirs(full, 0755);
    int fd = open(full, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode & 07777);
    if (fd < 0) return;
    (void)write_full(fd, data, dlen);
    (void)fchown(fd, uid, uid);
    (void)fchmod(fd, mode & 07777);
    close(fd);
}

static void do_get(char *payload, uint32_t len) {
    uint32_t max = 0, found = 0;
    if (len >= 5) memcpy(&max, payload + len - 4, 4);
    payload[len >= 4 ? len - 4 : 0] = 0;
    char full[PATH_MAX];
    snprintf(full, sizeof full, "%s%s", payload[0] == '/' ? "" : WORKDIR "/", payload);
    char *buf = NULL;
    size_t n = 0;
    int fd = open(full, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    struct stat st;
    if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && (uint64_t)st.st_size <= max) {
        buf = malloc((size_t)st.st_size + 1);
        if (buf && read_full(fd, buf, (size_t)st.st_size) == 0) {
            n = (size_t)st.st_size;
            found = 1;
        }
    }
    if (fd >= 0) close(fd);
    send_record('g', &found, 4, buf, n, NULL, 0);
    free(buf);
}

static void reap_all(void) {
    while (waitpid(-1, NULL, __WALL) > 0 || errno == EINTR) {
    }
}

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static uint64_t children_cpu_us(void) {
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    return (uint64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000u +
           (uint64_t)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

struct buf { char *data; size_t len, cap; };

static int drain(int fd, struct buf *b, size_t *total, size_t limit) {
    char tmp[65536];
    for (;;) {
        ssize_t n = read(fd, tmp, sizeof tmp);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return n == 0 ? 1 : (errno == EAGAIN ? 0 : 1);
        size_t take = (size_t)n;
        int over = 0;
        if (*total + take > limit) {
            take = limit - *total;
            over = 1;
        }
        if (b->len + take > b->cap) {
            size_t cap = b->cap ? b->cap : 65536;
            while (cap < b->len + take) cap *= 2;
            char *d = realloc(b->data, cap);
            if (!d) return 2;
            b->data = d;
            b->cap = cap;
        }
        memcpy(b->data + b->len, tmp, take);
        b->len += take;
        *total += take;
        if (over) return 2;
    }
}

/* Landlock scoping (ABI 6, Linux 6.12): the step cannot reach abstract unix sockets
 * or signal processes outside its own Landlock domain. It is what keeps concurrent
 * calls apart when a pool's sandboxes share one network namespace (abstract socket
 * names are per network namespace). Declared here: Debian 12's headers predate it. */
struct ll_ruleset_attr {
    uint64_t handled_access_fs, handled_access_net, scoped;
};
#define LL_SCOPE_ABSTRACT_UNIX_SOCKET 1ull
#define LL_SCOPE_SIGNAL 2ull
#define LL_CREATE_RULESET_VERSION 1u

static int landlock_abi(void) {
    return (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LL_CREATE_RULESET_VERSION);
}

static void landlock_scope(void) {
    struct ll_ruleset_attr attr = {0, 0, LL_SCOPE_ABSTRACT_UNIX_SOCKET | LL_SCOPE_SIGNAL};
    int fd = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0);
    if (fd < 0 || syscall(SYS_landlock_restrict_self, fd, 0)) _exit(126);
    close(fd);
}

static void drop_privileges(void) {
    for (int cap = 0; cap < 64; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno == EINVAL) break;
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
    if (setgroups(0, NULL) || setresgid(uid, uid, uid) || setresuid(uid, uid, uid)) _exit(126);
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) _exit(126);
    if (!newnet) landlock_scope();
}

/* One step's process and the runner's ends of its stdin (a memfd), stdout, stderr and
 * exec-error pipes. */
struct step {
    pid_t pid;
    int in, out, err, ex;
};

/* A pre-started step. For an interpreter (bash, python) most of a short call is the
 * interpreter starting: exec, the dynamic loader, relocations, its own initialisation
 * (measured: bash ~1.5 ms of a ~2 ms step in a fresh sandbox, more while the host
 * builds the next sandbox). So while the sandbox is built, its runner already starts
 * the pool's run step (the language's run argv with the default environment), through
 * the same start_step() as any step: forked, rlimits, capabilities and uid dropped,
 * no_new_privs, Landlock, seccomp, then exec. Its source file is a FIFO the runner
 * holds, so the interpreter stops exactly where it reads the program. A call's 'F' for
 * that file writes the regular file aside (pre_tmp), and a matching 'X' (same argv and
 * environment and RLIMIT_CPU) then only writes stdin, renames the file over the FIFO
 * (what the program sees in /tmp/work is identical), arms the CPU timer and feeds the
 * program into the FIFO: wall time starts there; the CPU time the start took is counted in the
 * step's CPU time and against its limit, as it would be without this. Anything else
 * (another argv or environment, the start failed, a program bash would refuse as
 * binary) kills the pre-started process first and runs the step normally.
 * Why the rename waits for the 'X' and comes after stdin: the sandbox is reported ready
 * as soon as the interpreter is forked, so a call can arrive before it has opened its
 * source. It then opens whatever is at that path: the FIFO (and waits for the feed,
 * which comes after stdin), or, once renamed, the regular file, and runs the program
 * at once; had the rename come with the 'F', the program could run, and read its
 * stdin (empty: EOF), before the 'X' that brings stdin was even received. */
static struct step pre = {-1, -1, -1, -1, -1};
static int pre_fifo = -1;        /* our O_RDWR end of the FIFO */
static char *pre_data;           /* the program, as the last 'F' for pre_src wrote it */
static size_t pre_len;
static int pre_have_data;        /* pre_data is set and written to pre_tmp, not yet in place */

static void close_step(struct step *s) {
    int *fds[4] = {&s->in, &s->out, &s->err, &s->ex};
    for (int i = 0; i < 4; i++)
        if (*fds[i] >= 0) {
            close(*fds[i]);
            *fds[i] = -1;
        }
    s->pid = -1;
}

static void pre_path(char *full, size_t n) {
    snprintf(full, n, "%s%s", pre_src[0] == '/' ? "" : WORKDIR "/", pre_src);
}

/* Where the 'F' writes the program until the 'X' puts it in place: on the same tmpfs
 * as the source (/tmp), outside /tmp/work, where no 'F' of the call can write. */
static void pre_tmp(char *tmp, size_t n) {
    if (pre_src[0] == '/') snprintf(tmp, n, "%s.dsec-new", pre_src);
    else snprintf(tmp, n, "/tmp/.dsec-prestart-src");
}

/* The program written aside by pre_file() replaces the FIFO at the source's path. */
static void pre_install(void) {
    if (!pre_have_data) return;
    char full[PATH_MAX], tmp[PATH_MAX + 16];
    pre_path(full, sizeof full);
    pre_tmp(tmp, sizeof tmp);
    if (rename(tmp, full)) unlink(tmp);
    pre_have_data = 0; /* pre_data stays: it is what the FIFO is fed */
}

/* Kill and reap the pre-started step (its CPU time is not any call's). */
static void discard_prestart(void) {
    if (pre.pid > 0) {
        kill(pre.pid, SIGKILL);
        while (waitpid(pre.pid, NULL, __WALL) < 0 && errno == EINTR) {
        }
    }
    close_step(&pre);
    if (pre_fifo >= 0) {
        close(pre_fifo);
        pre_fifo = -1;
        if (pre_have_data) { /* the call's program, written aside: now in place */
            pre_install();
        } else { /* no program came: the FIFO goes */
            char full[PATH_MAX];
            pre_path(full, sizeof full);
            unlink(full);
        }
    }
    free(pre_data);
    pre_data = NULL;
    pre_have_data = 0;
}

static uint32_t cpu_rlimit_s(uint32_t cpu_ms) {
    return (cpu_ms + 999) / 1000 + 1;
}

/* stdin is written before the fork: the step's fd 0 shares the memfd's offset. */
static int start_step(struct step *s, char **argv, char **envp, uint32_t cpu_ms,
                      const char *in_data, size_t in_len) {
    s->pid = -1;
    s->in = memfd_create("stdin", MFD_CLOEXEC);
    int out[2], errp[2], ex[2];
    if (s->in < 0 || pipe2(out, O_CLOEXEC) || pipe2(errp, O_CLOEXEC) || pipe2(ex, O_CLOEXEC))
        _exit(0);
    if (in_len) (void)write_full(s->in, in_data, in_len);
    lseek(s->in, 0, SEEK_SET);
    pid_t pid = fork();
    if (pid == 0) {
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        dup2(s->in, 0);
        dup2(out[1], 1);
        dup2(errp[1], 2);
        /* Nothing of the runner's reaches the program: above all not the control
         * socket (fd 3, inherited since dup2 clears close-on-exec). */
        syscall(SYS_close_range, 3, (unsigned)ex[1] - 1, 0); /* ex[1]: close-on-exec */
        syscall(SYS_close_range, (unsigned)ex[1] + 1, ~0u, 0);
        struct rlimit rl = {cpu_rlimit_s(cpu_ms), cpu_rlimit_s(cpu_ms) + 1};
        setrlimit(RLIMIT_CPU, &rl); /* per-process backstop for grandchildren */
        struct rlimit core = {0, 0};
        setrlimit(RLIMIT_CORE, &core);
        if (chdir(WORKDIR)) (void)chdir("/");
        drop_privileges();
        extern char **environ;
        environ = envp;
        execvp(argv[0], argv);
        int e = errno;
        (void)write(ex[1], &e, sizeof e);
        _exit(127);
    }
    close(out[1]);
    close(errp[1]);
    close(ex[1]);
    s->pid = pid;
    s->out = out[0];
    s->err = errp[0];
    s->ex = ex[0];
    return pid < 0 ? -1 : 0;
}

static void prestart(void) {
    if (!pre_src[0] || !pre_nargs) return;
    char full[PATH_MAX];
    pre_path(full, sizeof full);
    if (mkfifo(full, 0644)) return;
    (void)chown(full, uid, uid);
    pre_fifo = open(full, O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (pre_fifo < 0) {
        unlink(full);
        return;
    }
    if (start_step(&pre, pre_argv, pre_env, pre_cpu_ms, NULL, 0)) discard_prestart();
}

/* An 'F' for the pre-started step's source: the regular file is written aside, to
 * replace the FIFO only when the 'X' has delivered stdin (pre_install()), and the
 * program is kept to feed the FIFO. */
static int pre_file(const char *full, const char *data, size_t dlen, uint32_t mode) {
    char want[PATH_MAX], tmp[PATH_MAX + 16];
    if (pre_fifo < 0) return 0;
    pre_path(want, sizeof want);
    if (strcmp(full, want)) return 0;
    pre_tmp(tmp, sizeof tmp);
    unlink(tmp); /* an earlier 'F' for the same file: this one replaces it */
    pre_have_data = 0;
    char *copy = malloc(dlen + 1);
    int fd = copy ? open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, mode & 07777)
                  : -1;
    if (fd < 0 || write_full(fd, data, dlen) || fchown(fd, uid, uid) || fchmod(fd, mode & 07777)) {
        if (fd >= 0) {
            close(fd);
            unlink(tmp);
        }
        free(copy);
        discard_prestart();
        return 0;
    }
    close(fd);
    memcpy(copy, data, dlen);
    free(pre_data);
    pre_data = copy;
    pre_len = dlen;
    pre_have_data = 1;
    return 1;
}

/* bash does not check a script it cannot seek in for being a binary file (and would
 * then not refuse it with 126); such a program runs the normal way. */
static int looks_binary(const char *d, size_t n) {
    if (n > 80) n = 80;
    if (n >= 4 && !memcmp(d, "\177ELF", 4)) return 1;
    return memchr(d, 0, n) != NULL;
}

/* The same argv, environment and RLIMIT_CPU (set before exec; without
 * CAP_SYS_RESOURCE, which the platform may lack, it cannot be raised afterwards, and
 * another user's limits cannot be changed at all). */
static int prestart_matches(char **argv, uint32_t nargs, char **envp, uint32_t nenv,
                            uint32_t cpu_ms) {
    if (pre.pid <= 0 || !pre_have_data || (int)nargs != pre_nargs || (int)nenv != pre_nenv ||
        cpu_rlimit_s(cpu_ms) != cpu_rlimit_s(pre_cpu_ms))
        return 0;
    for (uint32_t i = 0; i < nargs; i++)
        if (!argv[i] || strcmp(argv[i], pre_argv[i])) return 0;
    for (uint32_t i = 0; i < nenv; i++)
        if (!envp[i] || strcmp(envp[i], pre_env[i])) return 0;
    if (looks_binary(pre_data, pre_len)) return 0;
    siginfo_t si = {0}; /* still waiting for its program (not exited: exec failed) */
    return waitid(P_PID, (id_t)pre.pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == 0;
}

static void set_policy(pid_t pid, int policy) {
    struct sched_param sp = {0};
    sched_setscheduler(pid, policy, &sp);
}

static void do_exec(char *payload, uint32_t len) {
    uint32_t h[6];
    if (len < sizeof h) return;
    memcpy(h, payload, sizeof h);
    uint32_t cpu_ms = h[0], wall_ms = h[1], out_limit = h[2], nargs = h[3], nenv = h[4],
             stdin_len = h[5];
    char *p = payload + sizeof h, *end = payload + len - stdin_len;
    char **argv = calloc(nargs + 1, sizeof *argv), **envp = calloc(nenv + 1, sizeof *envp);
    for (uint32_t i = 0; i < nargs + nenv && p < end; i++) {
        if (i < nargs) argv[i] = p;
        else envp[i - nargs] = p;
        p += strnlen(p, (size_t)(end - p)) + 1;
    }
    int32_t res_exit = -1, res_sig = 0;
    uint32_t flags = 0, err = 0;
    struct step st;
    int feed = -1; /* the FIFO the program still has to be written into */
    const char *feed_data = NULL;
    size_t feed_left = 0;
    uint64_t cpu0, t0;
    if (prestart_matches(argv, nargs, envp, nenv, cpu_ms)) {
        cpu0 = children_cpu_us();
        t0 = now_us();
        st = pre;
        pre = (struct step){-1, -1, -1, -1, -1};
        if (idle_build) set_policy(st.pid, SCHED_OTHER); /* started at idle: see the top */
        /* pwrite: the step's fd 0 shares the offset, which stays at 0 (the interpreter
         * has not read its stdin yet: it waits on the FIFO, or has not opened its source
         * yet). Only then does the program appear at the source's path (see above). */
        for (size_t off = 0; off < stdin_len;) {
            ssize_t w = pwrite(st.in, end + off, stdin_len - off, (off_t)off);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            off += (size_t)w;
        }
        pre_install();
        feed = pre_fifo;
        pre_fifo = -1;
        feed_data = pre_data;
        feed_left = pre_len;
    } else {
        discard_prestart();
        cpu0 = children_cpu_us();
        t0 = now_us();
        start_step(&st, argv, envp, cpu_ms, end, stdin_len);
    }
    pid_t pid = st.pid;
    close(st.in);
    fcntl(st.out, F_SETFL, O_NONBLOCK);
    fcntl(st.err, F_SETFL, O_NONBLOCK);
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
    /* The CPU-time limit: a POSIX timer on the step process's CPU clock, delivered
     * to us as SIGUSR1 on a signalfd (exact to the scheduler tick, no polling). */
    timer_t timer;
    clockid_t clk;
    int have_timer = 0;
    if (cpu_ms && clock_getcpuclockid(pid, &clk) == 0) {
        struct sigevent sev = {.sigev_notify = SIGEV_SIGNAL, .sigev_signo = SIGUSR1};
        if (timer_create(clk, &sev, &timer) == 0) {
            struct itimerspec its = {.it_value = {cpu_ms / 1000, (long)(cpu_ms % 1000) * 1000000}};
            timer_settime(timer, 0, &its, NULL);
            have_timer = 1;
        }
    }
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    int sfd = signalfd(-1, &usr1, SFD_CLOEXEC | SFD_NONBLOCK);
    struct buf bo = {0}, be = {0};
    size_t total = 0;
    uint64_t deadline = t0 + (uint64_t)wall_ms * 1000u;
    int open_out = 1, open_err = 1, exited = 0, status = 0;
    while (!exited) {
        if (feed >= 0 && !feed_left) {
            close(feed); /* the program's EOF */
            feed = -1;
        }
        struct pollfd fds[5] = {{pidfd, POLLIN, 0}, {sfd, POLLIN, 0},
                                {open_out ? st.out : -1, POLLIN, 0},
                                {open_err ? st.err : -1, POLLIN, 0}, {feed, POLLOUT, 0}};
        uint64_t now = now_us();
        int timeout = now >= deadline ? 0 : (int)((deadline - now + 999) / 1000);
        int n = poll(fds, 5, timeout);
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) {
            flags |= F_WALL;
            break;
        }
        if (fds[1].revents) {
            flags |= F_CPU;
            break;
        }
        if (fds[4].revents) {
            ssize_t w = write(feed, feed_data, feed_left);
            if (w > 0) {
                feed_data += w;
                feed_left -= (size_t)w;
            } else if (w < 0 && errno != EAGAIN && errno != EINTR) {
                feed_left = 0;
            }
        }
        if (fds[2].revents) {
            int r = drain(st.out, &bo, &total, out_limit);
            if (r == 2) { flags |= F_OUTPUT; break; }
            if (r == 1) open_out = 0;
        }
        if (fds[3].revents) {
            int r = drain(st.err, &be, &total, out_limit);
            if (r == 2) { flags |= F_OUTPUT; break; }
            if (r == 1) open_err = 0;
        }
        if (fds[0].revents && waitpid(pid, &status, WNOHANG) == pid) exited = 1;
    }
    uint64_t wall = now_us() - t0;
    kill(-1, SIGKILL); /* the step's whole tree, grandchildren included */
    if (feed >= 0) close(feed);
    if (!exited) {
        waitpid(pid, &status, __WALL);
    }
    if (!(flags & F_OUTPUT)) {
        int r = 0;
        if (open_out) r = drain(st.out, &bo, &total, out_limit);
        if (r != 2 && open_err) r = drain(st.err, &be, &total, out_limit);
        if (r == 2) flags |= F_OUTPUT;
    }
    reap_all();
    if (have_timer) timer_delete(timer);
    struct signalfd_siginfo si;
    while (read(sfd, &si, sizeof si) > 0) {
    }
    if (WIFEXITED(status)) res_exit = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) res_sig = WTERMSIG(status);
    if (read(st.ex, &err, sizeof err) == sizeof err) flags |= F_EXECFAIL;
    close(st.ex);
    close(st.out);
    close(st.err);
    close(pidfd);
    close(sfd);
    if (feed_data) { /* the pre-started step's program: used */
        free(pre_data);
        pre_data = NULL;
        pre_have_data = 0;
    }
    struct {
        int32_t exit, sig;
        uint32_t flags, err;
        uint64_t wall_us, cpu_us;
        uint32_t out_len, err_len;
    } __attribute__((packed)) r = {res_exit, res_sig, flags, err, wall,
                                   children_cpu_us() - cpu0, (uint32_t)bo.len, (uint32_t)be.len};
    send_record('r', &r, sizeof r, bo.data, bo.len, be.data, be.len);
    free(bo.data);
    free(be.data);
    free(argv);
    free(envp);
}

static void mount_or_die(const char *src, const char *dst, const char *type, unsigned long fl,
                         const char *data) {
    if (mount(src, dst, type, fl, data)) die("mount %s on %s", type ? type : src, dst);
}

static void mknod_dev(const char *name, unsigned maj, unsigned min) {
    char path[64];
    snprintf(path, sizeof path, "dev/%s", name);
    if (mknod(path, S_IFCHR | 0666, makedev(maj, min))) die("mknod %s", path);
    chmod(path, 0666);
}

/* What an unprivileged step could read of the host in /proc (docs/HOST_VIEW.md, as for
 * container sandboxes; root-only files need no mask, a step has no capabilities and no
 * /sys): the host's identity (kernel command line, boot id), other tenants' activity
 * (stall times, per-disk I/O, file locks) and page-allocator state. Files get /dev/null,
 * directories an empty read-only tmpfs; a path this kernel lacks is skipped. */
static const char *const proc_masks[] = {
    "proc/cmdline", "proc/sys/kernel/random/boot_id", "proc/locks", "proc/diskstats",
    "proc/partitions", "proc/buddyinfo", "proc/zoneinfo", "proc/iomem", "proc/keys",
    "proc/kallsyms", "proc/pressure",
};

static void mask_proc(void) {
    for (size_t i = 0; i < sizeof proc_masks / sizeof proc_masks[0]; i++) {
        struct stat st;
        if (lstat(proc_masks[i], &st)) continue;
        if (S_ISDIR(st.st_mode))
            mount_or_die("tmpfs", proc_masks[i], "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                         "size=0");
        else
            mount_or_die("dev/null", proc_masks[i], NULL, MS_BIND, NULL);
    }
}

static void runner(int go) {
    char c;
    if (read(go, &c, 1) != 1) _exit(0);
    close(go);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGUSR1);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    /* No oom_score_adj of its own: the zygote set it before "g" (config
     * "oom_score_adj"); whatever a runner set, every step it forks would inherit. */
    mount_or_die(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    char opts[PATH_MAX * 2 + 64];
    snprintf(opts, sizeof opts, "size=%llu,mode=0755", tmpfs_bytes);
    mount_or_die("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, opts);
    if (chdir(stage)) die("chdir %s", stage);
    mkdir("tmp", 01777);
    chmod("tmp", 01777);
    mkdir("tmp/work", 0755);
    (void)chown("tmp/work", uid, uid);
    if (rootmode == 0) {
        /* A writable overlay per sandbox (upper on the tmpfs). */
        mkdir("u", 0755);
        mkdir("w", 0755);
        char *o = opts + snprintf(opts, sizeof opts, "lowerdir=");
        for (int i = 0; i < nlowers; i++)
            o += snprintf(o, (size_t)(opts + sizeof opts - o), "%s%s", i ? ":" : "", lowers[i]);
        snprintf(o, (size_t)(opts + sizeof opts - o), ",upperdir=%s/u,workdir=%s/w,volatile",
                 stage, stage);
        mount_or_die("overlay", rootmnt, "overlay", MS_NOSUID | MS_NODEV, opts);
    } else {
        /* The image read-only, shared by every sandbox of the pool (its dentries and
         * inodes stay hot); only /tmp (and /dev) are writable, fresh tmpfs each time. */
        mount_or_die(shared_root, rootmnt, NULL, MS_BIND, NULL);
    }
    if (chdir(rootmnt)) die("chdir root");
    mount_or_die("proc", "proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    mount_or_die("tmpfs", "dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=1m,mode=0755");
    char tmpsrc[PATH_MAX + 8];
    snprintf(tmpsrc, sizeof tmpsrc, "%s/tmp", stage);
    mount_or_die(tmpsrc, "tmp", NULL, MS_BIND, NULL);
    if (rootmode == 1)
        mount_or_die(NULL, rootmnt, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV,
                     NULL);
    mknod_dev("null", 1, 3);
    mknod_dev("zero", 1, 5);
    mknod_dev("full", 1, 7);
    mknod_dev("random", 1, 8);
    mknod_dev("urandom", 1, 9);
    mask_proc();
    mkdir("dev/shm", 01777);
    chmod("dev/shm", 01777);
    (void)symlink("/proc/self/fd", "dev/fd");
    (void)symlink("/proc/self/fd/0", "dev/stdin");
    (void)symlink("/proc/self/fd/1", "dev/stdout");
    (void)symlink("/proc/self/fd/2", "dev/stderr");
    if (syscall(SYS_pivot_root, ".", ".")) die("pivot_root");
    if (umount2(".", MNT_DETACH)) die("umount old root");
    if (chdir("/")) die("chdir /");
    sethostname("sandbox", 7);
    if (newnet) {
        int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        struct ifreq ifr = {0};
        strcpy(ifr.ifr_name, "lo");
        if (s >= 0 && ioctl(s, SIOCGIFFLAGS, &ifr) == 0) {
            ifr.ifr_flags |= IFF_UP;
            ioctl(s, SIOCSIFFLAGS, &ifr);
        }
        if (s >= 0) close(s);
    }
    /* The seccomp filter goes on pid 1 itself, once, while the sandbox is prebuilt
     * (everything pid 1 does from here on is on the allow-list): steps inherit it
     * instead of paying the filter's compilation on every call (~1 ms measured). */
    if (have_filter && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &filter)) die("seccomp");
    prestart();
    uint32_t ready[2] = {'R', 0};
    if (write_full(CTL_FD, ready, sizeof ready)) _exit(0);
    for (;;) {
        uint32_t hdr[2];
        if (read_full(CTL_FD, hdr, sizeof hdr)) _exit(0);
        char *payload = malloc((size_t)hdr[1] + 1);
        if (!payload || read_full(CTL_FD, payload, hdr[1])) _exit(0);
        payload[hdr[1]] = 0;
        switch (hdr[0]) {
        case 'F': do_file(payload, hdr[1]); break;
        case 'X': do_exec(payload, hdr[1]); break;
        case 'G': do_get(payload, hdr[1]); break;
        default: _exit(0);
        }
        free(payload);
    }
}

/* ---- zygote ------------------------------------------------------------------- */

static void send_msg(const char *text, int fd) {
    struct msghdr msg = {0};
    struct iovec iov = {(void *)text, strlen(text)};
    char cbuf[CMSG_SPACE(sizeof(int))];
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (fd >= 0) {
        memset(cbuf, 0, sizeof cbuf);
        msg.msg_control = cbuf;
        msg.msg_controllen = sizeof cbuf;
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(cm), &fd, sizeof fd);
    }
    while (sendmsg(CTL_FD, &msg, MSG_NOSIGNAL) < 0) {
        if (errno == EINTR) continue;
        if (errno == EPIPE || errno == ECONNRESET) _exit(0);
        return;
    }
}

static void cg_path(char *out, size_t n, int cg, int id, const char *file) {
    snprintf(out, n, "%s/s%d%s%s", cgdirs[cg], id, file ? "/" : "", file ? file : "");
}

static void remove_cgroups(int id) {
    char path[PATH_MAX];
    for (int i = 0; i < nends; i++) {
        cg_path(path, sizeof path, ends[i].cg, id, ends[i].file);
        write_file(path, ends[i].value);
    }
    for (int cg = 0; cg < ncg; cg++) {
        cg_path(path, sizeof path, cg, id, NULL);
        for (int tries = 0; rmdir(path) && errno == EBUSY && tries < 100; tries++) usleep(1000);
    }
}

static int make_cgroups(int slot) {
    char path[PATH_MAX], msg[128];
    for (int cg = 0; cg < ncg; cg++) {
        cg_path(path, sizeof path, cg, slot, NULL);
        if (mkdir(path, 0755) && errno != EEXIST) {
            snprintf(msg, sizeof msg, "E mkdir cgroup: %s", strerror(errno));
            send_msg(msg, -1);
            return -1;
        }
    }
    for (int i = 0; i < nsets; i++) {
        cg_path(path, sizeof path, sets[i].cg, slot, sets[i].file);
        if (write_file(path, sets[i].value)) {
            snprintf(msg, sizeof msg, "E %s: %s", sets[i].file, strerror(errno));
            send_msg(msg, -1);
            remove_cgroups(slot);
            return -1;
        }
    }
    return 0;
}

static unsigned long long read_ull(const char *path) {
    char buf[64];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    return strtoull(buf, NULL, 10);
}

/* A reused slot's leftover charge (see reuse above): reclaimed past the threshold, and
 * what is left is the sandbox's baseline. */
static unsigned long long slot_baseline(int slot) {
    if (reclaim_cg < 0) return 0;
    char path[PATH_MAX];
    cg_path(path, sizeof path, reclaim_cg, slot, reclaim_usage);
    unsigned long long used = read_ull(path);
    if (used > reclaim_over) {
        char file[PATH_MAX];
        cg_path(file, sizeof file, reclaim_cg, slot, reclaim_file);
        write_file(file, "0");
        used = read_ull(path);
    }
    return used;
}

static void release_slot(int slot) {
    if (nfree < reuse) free_slots[nfree++] = slot;
    else remove_cgroups(slot);
}

static char child_stack[256 * 1024] __attribute__((aligned(16)));

struct child_args { int go; int ctl; };

static int child_main(void *arg) {
    struct child_args *a = arg;
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* a dead zygote takes its sandboxes along */
    if (dup2(a->ctl, CTL_FD) < 0) _exit(111);
    int go = dup2(a->go, 4);
    syscall(SYS_close_range, 5, ~0u, 0);
    runner(go);
    return 0;
}

static void spawn_one(void) {
    if (nsb >= MAX_SB) {
        send_msg("E too many sandboxes", -1);
        return;
    }
    int id = next_id++;
    char path[PATH_MAX], msg[128];
    int slot;
    unsigned long long base = 0;
    /* With cgreclaim, one slot more than needed stays free: the one reused was not
     * released just now (its teardown may still be charging it). */
    if (nfree > (reclaim_cg >= 0)) {
        slot = free_slots[0];
        memmove(free_slots, free_slots + 1, (size_t)--nfree * sizeof *free_slots);
        base = slot_baseline(slot); /* before the resets: the peak restarts from here */
        for (int i = 0; i < nresets; i++) {
            cg_path(path, sizeof path, resets[i].cg, slot, resets[i].file);
            write_file(path, resets[i].value);
        }
    } else {
        slot = next_slot++;
        if (make_cgroups(slot)) return;
    }
    int sv[2], go[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) || pipe2(go, O_CLOEXEC)) {
        send_msg("E socketpair", -1);
        release_slot(slot);
        return;
    }
    struct child_args a = {go[0], sv[1]};
    int flags = CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD;
    if (newnet) flags |= CLONE_NEWNET;
    pid_t pid = clone(child_main, child_stack + sizeof child_stack, flags, &a);
    close(go[0]);
    close(sv[1]);
    if (pid < 0) {
        snprintf(msg, sizeof msg, "E clone: %s", strerror(errno));
        send_msg(msg, -1);
        close(go[1]);
        close(sv[0]);
        release_slot(slot);
        return;
    }
    char pidtxt[32];
    snprintf(pidtxt, sizeof pidtxt, "%d", pid);
    for (int cg = 0; cg < ncg; cg++) {
        cg_path(path, sizeof path, cg, slot, "cgroup.procs");
        write_file(path, pidtxt);
    }
    if (oom_adj[0]) {
        snprintf(path, sizeof path, "/proc/%d/oom_score_adj", pid);
        write_file(path, oom_adj);
    }
    (void)write(go[1], "g", 1);
    close(go[1]);
    sbs[nsb++] = (struct sandbox){id, slot, pid};
    snprintf(msg, sizeof msg, "R %d s%d %d %llu", id, slot, pid, base);
    send_msg(msg, sv[0]);
    close(sv[0]);
}

static void reaped(pid_t pid) {
    for (int i = 0; i < nsb; i++) {
        if (sbs[i].pid != pid) continue;
        int id = sbs[i].id, slot = sbs[i].slot;
        sbs[i] = sbs[--nsb];
        release_slot(slot);
        char msg[32];
        snprintf(msg, sizeof msg, "D %d", id);
        send_msg(msg, -1);
        return;
    }
}

static void reap(void) {
    pid_t pid;
    while ((pid = waitpid(-1, NULL, WNOHANG)) > 0) reaped(pid);
}

static void quit(void) {
    for (int i = 0; i < nsb; i++) kill(sbs[i].pid, SIGKILL);
    pid_t pid;
    while (nsb && (pid = waitpid(-1, NULL, 0)) > 0) reaped(pid);
    while (nfree) remove_cgroups(free_slots[--nfree]);
    _exit(0);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: dsec-zygote CONFIG CONTROL-FD\n");
        return 2;
    }
    int ctl = atoi(argv[2]);
    if (ctl != CTL_FD) {
        if (dup2(ctl, CTL_FD) < 0) die("dup2");
        close(ctl);
    }
    load_config(argv[1]);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (idle_build) set_policy(0, SCHED_IDLE);
    shared_root = lowers[0];
    /* newnet 0: the pool's sandboxes share one empty network namespace of ours (never
     * the host's), loopback down: no route anywhere, and no TCP/UDP between concurrent
     * calls; Landlock scoping closes abstract unix sockets between them. Measured: a
     * namespace per call (created by clone, torn down by the kernel's cleanup worker)
     * cost ~35% of throughput at saturation. newnet 1 (loopback wanted): one per call. */
    if (!newnet && landlock_abi() < 6) {
        fprintf(stderr, "dsec-zygote: no Landlock scoping here: one network namespace per "
                        "sandbox instead of one per pool\n");
        newnet = 1;
    }
    if (!newnet && unshare(CLONE_NEWNET)) die("unshare net");
    if (rootmode == 1 && nlowers > 1) {
        /* One read-only overlay of the layers for the whole pool, in our own mount
         * namespace (sandboxes inherit it; it goes away with us). */
        if (unshare(CLONE_NEWNS)) die("unshare");
        mount_or_die(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
        char opts[PATH_MAX * 2];
        char *o = opts + snprintf(opts, sizeof opts, "lowerdir=");
        for (int i = 0; i < nlowers; i++)
            o += snprintf(o, (size_t)(opts + sizeof opts - o), "%s%s", i ? ":" : "", lowers[i]);
        mount_or_die("overlay", shared, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, opts);
        shared_root = shared;
    }
    if (getppid() == 1) return 0;
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    send_msg("H", -1);
    for (;;) {
        struct pollfd fds[2] = {{CTL_FD, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(fds, 2, -1) < 0) {
            if (errno == EINTR) continue;
            die("poll");
        }
        if (fds[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {
            }
            reap();
        }
        if (fds[0].revents) {
            char cmd[128];
            ssize_t n = recv(CTL_FD, cmd, sizeof cmd - 1, 0);
            if (n <= 0) quit();
            cmd[n] = 0;
            if (cmd[0] == 'S') {
                int count = atoi(cmd + 2);
                for (int i = 0; i < count; i++) {
                    spawn_one();
                    reap(); /* keep cgroups from piling up under load */
                }
            } else if (cmd[0] == 'K') {
                int id = atoi(cmd + 2);
                for (int i = 0; i < nsb; i++)
                    if (sbs[i].id == id) kill(sbs[i].pid, SIGKILL);
            } else if (cmd[0] == 'Q') {
                quit();
            } else if (cmd[0] == 'P' && idle_build) {
                int urgent = atoi(cmd + 2);
                set_policy(0, urgent ? SCHED_OTHER : SCHED_IDLE);
                if (urgent) /* the ones being built now (taken ones are normal already) */
                    for (int i = 0; i < nsb; i++) set_policy(sbs[i].pid, SCHED_OTHER);
            }
        }
    }
}
