/* Attempts a hostile root inside a sandbox makes, one per argv[1].
 *
 * Exit 0 and "denied errno=N" when the kernel refused the attempt; exit 1 and
 * "ALLOWED" when it went through (the test then fails); exit 2 for a usage error.
 * Built static on the host by the tests and copied into the sandbox, so the attempts
 * are the raw system calls, not whatever a shell applet happens to do.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/bpf.h>
#include <linux/keyctl.h>
#include <linux/perf_event.h>
#include <linux/reboot.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <arpa/inet.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/timex.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <netinet/in.h>
#include <linux/if_ether.h>
#include <sys/syscall.h>
#include <termios.h>

static int verdict(const char *what, long rc) {
    if (rc < 0) {
        printf("%s: denied errno=%d (%s)\n", what, errno, strerror(errno));
        return 0;
    }
    printf("%s: ALLOWED (rc=%ld)\n", what, rc);
    return 1;
}

static int attempt(const char *name, const char *arg) {
    if (!strcmp(name, "reboot"))
        return verdict(name, syscall(SYS_reboot, LINUX_REBOOT_MAGIC1, LINUX_REBOOT_MAGIC2,
                                     LINUX_REBOOT_CMD_CAD_OFF, NULL));
    if (!strcmp(name, "kexec_load"))
        return verdict(name, syscall(SYS_kexec_load, 0UL, 0UL, NULL, 0UL));
    if (!strcmp(name, "kexec_file_load"))
        return verdict(name, syscall(SYS_kexec_file_load, -1, -1, 0UL, "", 0UL));
    if (!strcmp(name, "init_module"))
        return verdict(name, syscall(SYS_init_module, "\x7f" "ELF", 4UL, ""));
    if (!strcmp(name, "finit_module")) {
        int fd = open("/bin/sh", O_RDONLY);
        return verdict(name, syscall(SYS_finit_module, fd, "", 0));
    }
    if (!strcmp(name, "delete_module"))
        return verdict(name, syscall(SYS_delete_module, "ext4", O_NONBLOCK));
    if (!strcmp(name, "swapon")) {
        int fd = open("/tmp/swapfile", O_CREAT | O_WRONLY, 0600);
        if (fd >= 0) { ftruncate(fd, 1 << 20); close(fd); }
        return verdict(name, syscall(SYS_swapon, "/tmp/swapfile", 0));
    }
    if (!strcmp(name, "clock_settime")) {
        struct timespec ts = {.tv_sec = 86400 * 365};
        return verdict(name, clock_settime(CLOCK_REALTIME, &ts));
    }
    if (!strcmp(name, "settimeofday")) {
        struct timeval tv = {.tv_sec = 86400 * 365};
        return verdict(name, syscall(SYS_settimeofday, &tv, NULL)); /* not glibc's wrapper */
    }
    if (!strcmp(name, "adjtimex")) {
        struct timex tx = {.modes = ADJ_OFFSET, .offset = 1000000};
        return verdict(name, syscall(SYS_adjtimex, &tx)); /* glibc would use clock_adjtime */
    }
    if (!strcmp(name, "add_key"))
        return verdict(name, syscall(SYS_add_key, "user", "dsec", "secret", 6UL,
                                     KEY_SPEC_PROCESS_KEYRING));
    if (!strcmp(name, "keyctl"))
        return verdict(name, syscall(SYS_keyctl, KEYCTL_JOIN_SESSION_KEYRING, "dsec-escape"));
    if (!strcmp(name, "bpf")) {
        union bpf_attr attr;
        memset(&attr, 0, sizeof attr);
        attr.map_type = BPF_MAP_TYPE_ARRAY;
        attr.key_size = 4;
        attr.value_size = 4;
        attr.max_entries = 1;
        return verdict(name, syscall(SYS_bpf, BPF_MAP_CREATE, &attr, sizeof attr));
    }
    if (!strcmp(name, "perf_event_open")) {
        struct perf_event_attr pe;
        memset(&pe, 0, sizeof pe);
        pe.size = sizeof pe;
        pe.type = PERF_TYPE_SOFTWARE;
        pe.config = PERF_COUNT_SW_CPU_CLOCK;
        return verdict(name, syscall(SYS_perf_event_open, &pe, 0, -1, -1, 0UL));
    }
    if (!strcmp(name, "userfaultfd"))
        return verdict(name, syscall(SYS_userfaultfd, 0));
    if (!strcmp(name, "ptrace_init"))
        return verdict(name, ptrace(PTRACE_ATTACH, 1, NULL, NULL));
    if (!strcmp(name, "ptrace_sibling")) {
        pid_t child = fork();
        if (child == 0) { pause(); _exit(0); }
        long rc = ptrace(PTRACE_ATTACH, child, NULL, NULL);
        int saved = errno;
        kill(child, SIGKILL);
        waitpid(child, NULL, 0);
        errno = saved;
        return verdict(name, rc);
    }
    if (!strcmp(name, "process_vm_readv")) {
        char buf[16];
        struct iovec local = {buf, sizeof buf}, remote = {(void *)0x400000, sizeof buf};
        return verdict(name, syscall(SYS_process_vm_readv, 1, &local, 1UL, &remote, 1UL, 0UL));
    }
    if (!strcmp(name, "pidfd_getfd")) { /* steal pid 1's agent socket (fd 3) */
        int pidfd = (int)syscall(SYS_pidfd_open, 1, 0);
        if (pidfd < 0) return verdict("pidfd_open", -1);
        return verdict(name, syscall(SYS_pidfd_getfd, pidfd, 3, 0));
    }
    if (!strcmp(name, "unshare_user"))
        return verdict(name, unshare(CLONE_NEWUSER));
    if (!strcmp(name, "unshare_mount"))
        return verdict(name, unshare(CLONE_NEWNS));
    if (!strcmp(name, "setns")) { /* re-joining even its own namespace is refused */
        int fd = open("/proc/self/ns/net", O_RDONLY);
        if (fd < 0) return verdict("open /proc/self/ns/net", -1);
        return verdict(name, setns(fd, 0));
    }
    if (!strcmp(name, "mount_tmpfs")) {
        mkdir("/tmp/m", 0700);
        return verdict(name, mount("none", "/tmp/m", "tmpfs", 0, NULL));
    }
    if (!strcmp(name, "mount_proc")) {
        mkdir("/tmp/p", 0700);
        return verdict(name, mount("proc", "/tmp/p", "proc", 0, NULL));
    }
    if (!strcmp(name, "remount_root_rw"))
        return verdict(name, mount(NULL, "/.dsec/init", NULL, MS_REMOUNT | MS_BIND, NULL));
    if (!strcmp(name, "umount_proc_mask"))
        return verdict(name, umount2("/proc/kcore", MNT_DETACH));
    if (!strcmp(name, "open_by_handle_at")) { /* "shocker": open host inodes by handle */
        struct { unsigned int bytes; int type; unsigned char f[8]; } h = {8, 1, {2, 0}};
        return verdict(name, syscall(SYS_open_by_handle_at, AT_FDCWD, &h, O_RDONLY));
    }
    if (!strcmp(name, "raw_socket"))
        return verdict(name, socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    if (!strcmp(name, "packet_socket")) /* ARP spoofing needs AF_PACKET */
        return verdict(name, socket(AF_PACKET, SOCK_RAW, htons(ETH_P_ARP)));
    if (!strcmp(name, "iopl"))
        return verdict(name, syscall(SYS_iopl, 3));
    if (!strcmp(name, "ioperm"))
        return verdict(name, syscall(SYS_ioperm, 0x60UL, 8UL, 1));
    if (!strcmp(name, "syslog"))
        return verdict(name, syscall(SYS_syslog, 3 /* READ_ALL */, (char[64]){0}, 64));
    if (!strcmp(name, "acct"))
        return verdict(name, syscall(SYS_acct, "/tmp/acct"));
    if (!strcmp(name, "mknod_disk")) { /* a block device node for the host disk */
        struct stat st;
        if (stat("/", &st) != 0) return verdict("stat", -1);
        unlink("/tmp/disk");
        if (mknod("/tmp/disk", S_IFBLK | 0600, makedev(253, 0)) < 0 &&
            mknod("/tmp/disk", S_IFBLK | 0600, makedev(254, 0)) < 0)
            return verdict(name, -1);
        return verdict("open block device", open("/tmp/disk", O_RDONLY));
    }
    if (!strcmp(name, "chroot_escape")) { /* the classic: chroot, walk up, chroot . */
        mkdir("/tmp/jail", 0700);
        int fd = open("/", O_RDONLY);
        if (chroot("/tmp/jail") < 0) return verdict(name, -1);
        if (fchdir(fd) < 0) return verdict("fchdir", -1);
        for (int i = 0; i < 64; i++) chdir("..");
        if (chroot(".") < 0) return verdict("chroot .", -1);
        /* Escaped the jail; still inside the sandbox root? The agent must be there. */
        struct stat st;
        if (stat("/.dsec/init", &st) == 0) {
            printf("%s: contained (walked up to the sandbox root, not the host)\n", name);
            return 0;
        }
        printf("%s: ALLOWED (reached a root without the sandbox agent)\n", name);
        return 1;
    }
    if (!strcmp(name, "connect_unix")) { /* forge a request to a host unix socket */
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        int s = socket(AF_UNIX, SOCK_STREAM, 0);
        socklen_t len;
        if (arg[0] == '@') { /* abstract namespace */
            sa.sun_path[0] = 0;
            strncpy(sa.sun_path + 1, arg + 1, sizeof sa.sun_path - 2);
            len = offsetof(struct sockaddr_un, sun_path) + 1 + strlen(arg + 1);
        } else {
            strncpy(sa.sun_path, arg, sizeof sa.sun_path - 1);
            len = sizeof sa;
        }
        return verdict(name, connect(s, (struct sockaddr *)&sa, len));
    }
    if (!strcmp(name, "connect_tcp")) { /* arg: a.b.c.d:port */
        char host[64];
        int port = 0;
        if (sscanf(arg, "%63[^:]:%d", host, &port) != 2) return 2;
        struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((unsigned short)port)};
        inet_pton(AF_INET, host, &sa.sin_addr);
        int s = socket(AF_INET, SOCK_STREAM, 0);
        struct timeval tv = {.tv_sec = 2};
        setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        return verdict(name, connect(s, (struct sockaddr *)&sa, sizeof sa));
    }
    if (!strcmp(name, "write")) { /* arg: path; write one byte to it */
        int fd = open(arg, O_WRONLY);
        if (fd < 0) return verdict(name, -1);
        return verdict(name, write(fd, "1", 1));
    }
    if (!strcmp(name, "read")) { /* arg: path; read from it */
        char buf[64];
        int fd = open(arg, O_RDONLY);
        if (fd < 0) return verdict(name, -1);
        long n = read(fd, buf, sizeof buf);
        if (n == 0) { printf("%s: empty (masked)\n", name); return 0; }
        return verdict(name, n);
    }
    if (!strcmp(name, "fill_inodes")) { /* arg: directory; empty files until refused */
        char path[4096];
        long n = 0;
        mkdir(arg, 0755);
        for (;; n++) {
            snprintf(path, sizeof path, "%s/f%ld", arg, n);
            int fd = open(path, O_CREAT | O_WRONLY | O_EXCL, 0644);
            if (fd < 0) break;
            close(fd);
        }
        printf("%s: stopped after %ld files: ", name, n);
        return verdict(name, -1);
    }
    if (!strcmp(name, "memfd_secret")) /* memory our detectors could not read */
        return verdict(name, syscall(447 /* SYS_memfd_secret */, 0));
    if (!strcmp(name, "sethostname")) /* allowed in the sandbox's own UTS namespace */
        return verdict(name, sethostname("pwned", 5));
    fprintf(stderr, "unknown attempt %s\n", name);
    return 2;
}

/* ---- signals at pid 1 ------------------------------------------------------------ */
/* Each attempt tries to end the sandbox by signalling its pid 1 and prints what each
 * call returned; whether pid 1 survived is judged from outside (the test asks the
 * platform). Exit 0 unless the attempt could not be set up. */

static void report(const char *what, long rc) {
    if (rc < 0)
        printf("%s: refused errno=%d (%s)\n", what, errno, strerror(errno));
    else
        printf("%s: sent (rc=%ld)\n", what, rc);
}

static char pid1_state(void) {
    char buf[256] = {0};
    int fd = open("/proc/1/stat", O_RDONLY);
    if (fd < 0) return '?';
    read(fd, buf, sizeof buf - 1);
    close(fd);
    char *p = strrchr(buf, ')');
    return p && p[1] == ' ' ? p[2] : '?';
}

static int settle(void) {
    usleep(200 * 1000);
    printf("pid1: %s state=%c\n", kill(1, 0) == 0 ? "alive" : "gone", pid1_state());
    return 0;
}

static long queue_forged(pid_t tgid, int sig, int use_tg) {
    siginfo_t si;
    memset(&si, 0, sizeof si);
    si.si_signo = sig;
    si.si_code = SI_QUEUE; /* the only codes a process may choose: negative ones */
    si.si_pid = 0;         /* "from the host", or so it says */
    si.si_uid = 0;
    if (use_tg) return syscall(SYS_rt_tgsigqueueinfo, tgid, tgid, sig, &si);
    return syscall(SYS_rt_sigqueueinfo, tgid, sig, &si);
}

static int async_signal_to(int fd, int owner_type, pid_t owner, int sig) {
    struct f_owner_ex ex = {.type = owner_type, .pid = owner};
    if (fcntl(fd, F_SETOWN_EX, &ex) < 0) { report("F_SETOWN_EX", -1); return -1; }
    if (fcntl(fd, F_SETSIG, sig) < 0) { report("F_SETSIG", -1); return -1; }
    int fl = fcntl(fd, F_GETFL);
    if (fcntl(fd, F_SETFL, fl | O_ASYNC) < 0) { report("O_ASYNC", -1); return -1; }
    return 0;
}

static int signal_attempt(const char *name, const char *arg) {
    if (!strcmp(name, "sig_every")) { /* every signal number, from a root shell's view */
        int refused = 0, sent = 0;
        for (int sig = 1; sig < 65; sig++) {
            if (sig == SIGKILL || sig == SIGSTOP) continue;
            if (kill(1, sig) < 0) refused++; else sent++;
        }
        printf("sig_every: refused=%d sent=%d\n", refused, sent);
        return settle();
    }
    if (!strcmp(name, "sig_kill_stop")) {
        report("kill(1, SIGKILL)", kill(1, SIGKILL));
        report("kill(1, SIGSTOP)", kill(1, SIGSTOP));
        return settle();
    }
    if (!strcmp(name, "sig_wide_pid")) { /* the kernel truncates the pid to 32 bits */
        report("kill(1<<32|1, SIGTERM)", syscall(SYS_kill, (1L << 32) | 1, SIGTERM));
        report("kill(-1<<32|1, SIGINT)", syscall(SYS_kill, (long)0xffffffff00000001UL, SIGINT));
        return settle();
    }
    if (!strcmp(name, "sig_broadcast")) { /* kill(-1): everything but pid 1, and us */
        report("kill(-1, SIGTERM)", kill(-1, SIGTERM));
        report("kill(-1, SIGKILL)", kill(-1, SIGKILL));
        return settle();
    }
    if (!strcmp(name, "sig_thread")) {
        report("tgkill(1, 1, SIGTERM)", syscall(SYS_tgkill, 1, 1, SIGTERM));
        report("tkill(1, SIGINT)", syscall(SYS_tkill, 1, SIGINT));
        return settle();
    }
    if (!strcmp(name, "sig_queue_forged")) { /* claims si_pid 0, as if from the host */
        report("rt_sigqueueinfo(1, SIGTERM)", queue_forged(1, SIGTERM, 0));
        report("rt_tgsigqueueinfo(1, 1, SIGINT)", queue_forged(1, SIGINT, 1));
        return settle();
    }
    if (!strcmp(name, "sig_pidfd")) { /* no pid for a filter to read: a pidfd, /proc/1 */
        int pfd = (int)syscall(SYS_pidfd_open, 1, 0);
        if (pfd < 0) { report("pidfd_open(1)", -1); return 2; }
        report("pidfd_send_signal(SIGTERM)", syscall(SYS_pidfd_send_signal, pfd, SIGTERM, NULL, 0));
        siginfo_t si;
        memset(&si, 0, sizeof si);
        si.si_signo = SIGINT;
        si.si_code = SI_QUEUE;
        si.si_pid = 0;
        report("pidfd_send_signal(SIGINT, forged host pid)",
               syscall(SYS_pidfd_send_signal, pfd, SIGINT, &si, 0));
        report("pidfd_send_signal(SIGKILL)", syscall(SYS_pidfd_send_signal, pfd, SIGKILL, NULL, 0));
        int dfd = open("/proc/1", O_RDONLY | O_DIRECTORY);
        if (dfd >= 0)
            report("pidfd_send_signal(/proc/1, SIGHUP)",
                   syscall(SYS_pidfd_send_signal, dfd, SIGHUP, NULL, 0));
        return settle();
    }
    if (!strcmp(name, "sig_async_io")) { /* F_SETOWN + F_SETSIG: the kernel sends it */
        int p[2];
        if (pipe(p) < 0) return 2;
        if (async_signal_to(p[0], F_OWNER_PID, 1, SIGTERM) < 0) return 2;
        report("write (SIGTERM to pid 1 by SIGIO)", write(p[1], "x", 1));
        int q[2];
        if (pipe(q) < 0) return 2;
        /* process group 1: pid 1 and its helpers */
        if (async_signal_to(q[0], F_OWNER_PGRP, 1, SIGINT) < 0) return 2;
        report("write (SIGINT to process group 1 by SIGIO)", write(q[1], "x", 1));
        return settle();
    }
    if (!strcmp(name, "sig_tty_hangup")) { /* a terminal that hangs up on pid 1 */
        pid_t child = fork();
        if (child == 0) {
            setsid();
            int m = posix_openpt(O_RDWR | O_NOCTTY);
            if (m < 0 || grantpt(m) < 0 || unlockpt(m) < 0) _exit(3);
            int sl = open(ptsname(m), O_RDWR); /* our controlling terminal now */
            if (sl < 0) _exit(3);
            pid_t one = 1;
            report("TIOCSPGRP to process group 1", ioctl(sl, TIOCSPGRP, &one));
            report("setpgid(0, 1)", setpgid(0, 1));
            /* the master signals its owner, pid 1, with SIGHUP on output and hangup */
            if (async_signal_to(m, F_OWNER_PID, 1, SIGHUP) < 0) _exit(3);
            signal(SIGHUP, SIG_IGN);
            report("write to the terminal", write(sl, "bye\n", 4));
            usleep(50 * 1000);
            close(sl);
            report("vhangup", syscall(SYS_vhangup));
            _exit(0);
        }
        int st;
        waitpid(child, &st, 0);
        printf("tty child: exit %d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
        return settle();
    }
    if (!strcmp(name, "sig_new_session")) { /* a detached child in its own session */
        pid_t child = fork();
        if (child == 0) {
            setsid();
            if (fork() == 0) { /* an orphan: its parent exits, pid 1's supervisor adopts */
                usleep(50 * 1000);
                report("orphan kill(1, SIGTERM)", kill(1, SIGTERM));
                report("orphan kill(1, SIGQUIT)", kill(1, SIGQUIT));
                _exit(0);
            }
            _exit(0);
        }
        waitpid(child, NULL, 0);
        usleep(200 * 1000);
        return settle();
    }
    if (!strcmp(name, "sig_flood")) { /* arg: count; real-time signals queue, by pidfd */
        int n = arg[0] ? atoi(arg) : 5000, ok = 0;
        int pfd = (int)syscall(SYS_pidfd_open, 1, 0);
        if (pfd < 0) return 2;
        for (int i = 0; i < n; i++)
            if (syscall(SYS_pidfd_send_signal, pfd, SIGRTMIN + (i % 8), NULL, 0) == 0) ok++;
        printf("sig_flood: sent %d of %d\n", ok, n);
        return settle();
    }
    return -1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: attack NAME [ARG]\n");
        return 2;
    }
    setvbuf(stdout, NULL, _IONBF, 0);
    if (!strncmp(argv[1], "sig_", 4)) {
        int rc = signal_attempt(argv[1], argc > 2 ? argv[2] : "");
        if (rc >= 0) return rc;
    }
    return attempt(argv[1], argc > 2 ? argv[2] : "");
}
