/* dsec-vmjail: confine one QEMU process, then exec it in place (same pid).
 *
 * Usage: dsec-vmjail [--cgroup DIR]... [--own PATH]... [--ro PATH]... [--rw PATH]...
 *                    [--dev PATH]... --uid-base N [--as-uid N] [--group N]... [--netns]
 *                    [--die-with-parent] -- QEMU ARGV...
 *
 * Order matters and is the point of doing it in C before exec:
 *  1. join the sandbox's cgroups (every hierarchy), so QEMU's first allocation is
 *     already charged there;
 *  2. the uid is uid-base + our pid: unique among live VMs without any allocation
 *     state (a pid is unique while the process lives), so two QEMUs never share a uid
 *     and cannot signal or ptrace each other; the gid is the same number; --own paths
 *     are chowned to it; --group adds a supplementary group (the kvm group);
 *     --as-uid N (N >= uid-base) runs as that uid instead: a helper working on one
 *     VM's files on its behalf (qemu-img copying its overlay at a snapshot) gets that
 *     VM's QEMU's uid, so it reaches those files and nothing more than QEMU could;
 *  3. new mount, ipc, uts (and with --netns an empty network) namespaces; the new root
 *     is an empty read-only tmpfs holding only /usr (and the merged-usr symlinks),
 *     a few /dev nodes and the --ro / --rw paths bound at their own paths, so argv
 *     paths stay valid and nothing else of the host is reachable (no /proc, /sys,
 *     /home, /var, other VMs' directories);
 *  4. drop every capability (bounding set too), setgroups/setgid/setuid, no_new_privs.
 * A pid namespace is not used: it would need a fork, so the pid the host tracks would
 * not be QEMU's; the per-VM uid and the missing /proc give the same separation.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define MAX_ARGS 64
#define ROOT "/run/dsec-vmjail"

static void die(const char *what, const char *arg) {
    fprintf(stderr, "dsec-vmjail: %s %s: %s\n", what, arg ? arg : "", strerror(errno));
    _exit(125);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die("open", path);
    if (write(fd, text, strlen(text)) < 0) die("write", path);
    close(fd);
}

/* mkdir -p of every parent of PATH below the new root. */
static void make_parents(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s%s", ROOT, path) >= (int)sizeof buf) die("path too long", path);
    for (char *p = buf + strlen(ROOT) + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) < 0 && errno != EEXIST) die("mkdir", buf);
        *p = '/';
    }
}

static void bind(const char *path, int readonly) {
    struct stat st;
    char target[PATH_MAX];
    if (path[0] != '/') { errno = EINVAL; die("not an absolute path", path); }
    if (stat(path, &st) < 0) die("stat", path);
    make_parents(path);
    snprintf(target, sizeof target, "%s%s", ROOT, path);
    if (S_ISDIR(st.st_mode)) {
        if (mkdir(target, 0755) < 0 && errno != EEXIST) die("mkdir", target);
    } else {
        int fd = open(target, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd < 0) die("create", target);
        close(fd);
    }
    if (mount(path, target, NULL, MS_BIND | MS_REC, NULL) < 0) die("bind", path);
    unsigned long flags = MS_BIND | MS_REMOUNT | MS_NOSUID;
    if (readonly) flags |= MS_RDONLY;
    if (!S_ISCHR(st.st_mode) && !S_ISBLK(st.st_mode)) flags |= MS_NODEV;
    if (mount(NULL, target, NULL, flags, NULL) < 0) die("remount", path);
}

/* /bin, /lib, /lib64, /sbin: a symlink on merged-usr hosts (copy it), else bind. */
static void top_level(const char *path) {
    char link[PATH_MAX], target[PATH_MAX];
    ssize_t n = readlink(path, link, sizeof link - 1);
    if (n < 0) {
        if (errno == ENOENT) return;
        bind(path, 1);
        return;
    }
    link[n] = 0;
    snprintf(target, sizeof target, "%s%s", ROOT, path);
    if (symlink(link, target) < 0) die("symlink", target);
}

static long number(const char *s) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < 0) { errno = EINVAL; die("bad number", s); }
    return v;
}

int main(int argc, char **argv) {
    const char *cgroups[MAX_ARGS], *own[MAX_ARGS], *ro[MAX_ARGS], *rw[MAX_ARGS], *dev[MAX_ARGS];
    int ncg = 0, nown = 0, nro = 0, nrw = 0, ndev = 0, netns = 0, ngroups = 0;
    int die_with_parent = 0;  /* a VM that is not a sandbox (a template build) */
    pid_t parent = getppid();
    long uid_base = -1, as_uid = -1;
    gid_t groups[8];
    int i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) { i++; break; }
        if (!strcmp(a, "--netns")) { netns = 1; continue; }
        if (!strcmp(a, "--die-with-parent")) { die_with_parent = 1; continue; }
        if (i + 1 >= argc) { errno = EINVAL; die("missing value for", a); }
        const char *v = argv[++i];
        if (ncg >= MAX_ARGS || nown >= MAX_ARGS || nro >= MAX_ARGS || nrw >= MAX_ARGS || ndev >= MAX_ARGS) {
            errno = E2BIG; die("too many paths", NULL);
        }
        if (!strcmp(a, "--cgroup")) cgroups[ncg++] = v;
        else if (!strcmp(a, "--own")) own[nown++] = v;
        else if (!strcmp(a, "--ro")) ro[nro++] = v;
        else if (!strcmp(a, "--rw")) rw[nrw++] = v;
        else if (!strcmp(a, "--dev")) dev[ndev++] = v;
        else if (!strcmp(a, "--uid-base")) uid_base = number(v);
        else if (!strcmp(a, "--as-uid")) as_uid = number(v);
        else if (!strcmp(a, "--group")) {
            if (ngroups >= 8) { errno = E2BIG; die("too many groups", NULL); }
            groups[ngroups++] = (gid_t)number(v);
        } else { errno = EINVAL; die("unknown option", a); }
    }
    if (i >= argc || uid_base < 0) {
        fprintf(stderr, "usage: dsec-vmjail --uid-base N [options] -- argv...\n");
        return 125;
    }
    if (as_uid >= 0 && as_uid < uid_base) { errno = EINVAL; die("--as-uid below --uid-base", NULL); }
    pid_t pid = getpid();
    uid_t uid = (uid_t)(as_uid >= 0 ? as_uid : uid_base + pid);
    gid_t gid = (gid_t)uid;
    char pidtext[32];
    snprintf(pidtext, sizeof pidtext, "%d\n", (int)pid);
    for (int k = 0; k < ncg; k++) {
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/cgroup.procs", cgroups[k]);
        write_file(path, pidtext);
    }
    for (int k = 0; k < nown; k++)
        if (chown(own[k], uid, gid) < 0) die("chown", own[k]);

    if (unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | (netns ? CLONE_NEWNET : 0)) < 0)
        die("unshare", NULL);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) die("make private", "/");
    if (mkdir(ROOT, 0700) < 0 && errno != EEXIST) die("mkdir", ROOT);
    if (mount("vmjail", ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755") < 0)
        die("mount tmpfs", ROOT);
    bind("/usr", 1);
    top_level("/bin");
    top_level("/lib");
    top_level("/lib64");
    top_level("/sbin");
    if (mkdir(ROOT "/dev", 0755) < 0) die("mkdir", ROOT "/dev");
    bind("/dev/null", 0);
    bind("/dev/zero", 0);
    bind("/dev/urandom", 0);
    for (int k = 0; k < ndev; k++) bind(dev[k], 0);
    for (int k = 0; k < nro; k++) bind(ro[k], 1);
    for (int k = 0; k < nrw; k++) bind(rw[k], 0);
    if (chdir(ROOT) < 0) die("chdir", ROOT);
    if (syscall(SYS_pivot_root, ".", ".") < 0) die("pivot_root", ROOT);
    if (umount2(".", MNT_DETACH) < 0) die("umount old root", NULL);
    if (chdir("/") < 0) die("chdir", "/");
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) < 0)
        die("remount root read-only", NULL);
    sethostname("dsec-vmm", 8);

    for (int cap = 0; cap <= 63; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 && errno != EINVAL) die("capbset drop", NULL);
    if (setgroups((size_t)ngroups, groups) < 0) die("setgroups", NULL);
    if (setresgid(gid, gid, gid) < 0) die("setresgid", NULL);
    if (setresuid(uid, uid, uid) < 0) die("setresuid", NULL);  /* clears every capability */
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0) die("no_new_privs", NULL);
    if (die_with_parent) {
        /* after setresuid, which clears it; then check the parent did not die first */
        if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0) die("pdeathsig", NULL);
        if (getppid() != parent) return 125;
    }
    execv(argv[i], argv + i);
    die("exec", argv[i]);
    return 125;
}
