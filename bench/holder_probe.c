/*
 * holder_probe: the kernel objects of N idle sandboxes without any platform (issue 19,
 * bench/host_floor.py). Each "holder" is one sleeping process in network, pid, ipc, uts
 * and mount namespaces of its own, in cgroups of its own (one under each PARENT) with a
 * default 64 MiB sandbox's limits, and with proc, a /dev tmpfs and a devpts instance
 * mounted in its mount namespace: what a sandbox's pid 1 costs the kernel, less the
 * overlay root and everything a platform adds.
 *
 *   holder_probe PARENT...   (cgroup directories to create in: v1 hierarchies or v2)
 *
 * Reads lines on stdin: "add K" makes K more holders and answers "ok TOTAL" (or
 * "error ..."). At EOF it kills and reaps every holder, removes their memory cgroups
 * and exits: the holders are its children and die with it (PR_SET_PDEATHSIG), so none
 * is left behind however the bench ends.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char **g_parents;
static int g_nparents;
static pid_t *g_pids;
static size_t g_count, g_cap;

static unsigned char g_stack[64 * 1024] __attribute__((aligned(16)));

struct start {
	int ready; /* pipe: one byte, '1' when set up, or the errno that stopped it */
	size_t index;
};

static void __attribute__((noreturn)) fail(int fd, int err)
{
	unsigned char b = (unsigned char)(err ? err : 255);
	if (write(fd, &b, 1) < 0) {
	}
	_exit(1);
}

static int holder(void *arg)
{
	struct start *s = arg;
	prctl(PR_SET_PDEATHSIG, SIGKILL);
	/* not the probe's stdio: its reader sees EOF when the probe ends, whatever we do */
	close(0);
	close(1);
	close(2);
	for (int i = 0; i < g_nparents; i++) {
		char path[4096];
		snprintf(path, sizeof path, "%s/h%zu/cgroup.procs", g_parents[i], s->index);
		int fd = open(path, O_WRONLY);
		if (fd < 0 || write(fd, "0", 1) != 1)
			fail(s->ready, errno);
		close(fd);
	}
	if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0 ||
	    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) < 0 ||
	    mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "mode=755,size=65536k") < 0 ||
	    mkdir("/dev/pts", 0755) < 0 ||
	    mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666") < 0)
		fail(s->ready, errno);
	unsigned char ok = '1';
	if (write(s->ready, &ok, 1) < 0) {
	}
	close(s->ready);
	for (;;)
		pause();
	return 0;
}

/* A default 64 MiB sandbox's limits (dsec.backends.container.oci_spec), in whichever
 * of these files the cgroup has: v1 names, then v2. The CPU quota's writes are the ones
 * the kernel checks against every task group on the host. */
static const char *const LIMITS[][2] = {
	{"cpu.cfs_period_us", "100000"}, {"cpu.cfs_quota_us", "100000"}, {"cpu.shares", "4096"},
	{"memory.limit_in_bytes", "67108864"}, {"cpu.max", "100000 100000"},
	{"cpu.weight", "156"}, {"memory.max", "67108864"}, {"pids.max", "1024"},
};

static void rm_cgroups(size_t index)
{
	for (int i = 0; i < g_nparents; i++) {
		char dir[4096];
		snprintf(dir, sizeof dir, "%s/h%zu", g_parents[i], index);
		for (int tries = 0; rmdir(dir) < 0 && errno == EBUSY && tries < 100; tries++)
			usleep(10000);
	}
}

static int make_cgroups(char *err, size_t errlen)
{
	for (int i = 0; i < g_nparents; i++) {
		char dir[4096];
		snprintf(dir, sizeof dir, "%s/h%zu", g_parents[i], g_count);
		if (mkdir(dir, 0755) < 0 && errno != EEXIST) {
			snprintf(err, errlen, "mkdir %s: %s", dir, strerror(errno));
			return -1;
		}
		for (size_t k = 0; k < sizeof LIMITS / sizeof LIMITS[0]; k++) {
			char path[4200];
			snprintf(path, sizeof path, "%s/%s", dir, LIMITS[k][0]);
			int fd = open(path, O_WRONLY);
			if (fd < 0)
				continue; /* not this hierarchy's file */
			ssize_t n = write(fd, LIMITS[k][1], strlen(LIMITS[k][1]));
			int e = errno;
			close(fd);
			if (n < 0) {
				snprintf(err, errlen, "write %s: %s", path, strerror(e));
				return -1;
			}
		}
	}
	return 0;
}

static int add_one(char *err, size_t errlen)
{
	if (make_cgroups(err, errlen) < 0) {
		rm_cgroups(g_count);
		return -1;
	}
	int p[2];
	if (pipe2(p, O_CLOEXEC) < 0) {
		snprintf(err, errlen, "pipe: %s", strerror(errno));
		rm_cgroups(g_count);
		return -1;
	}
	struct start s = {p[1], g_count};
	int flags = CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNS | SIGCHLD;
	pid_t pid = clone(holder, g_stack + sizeof g_stack, flags, &s);
	close(p[1]);
	if (pid < 0) {
		snprintf(err, errlen, "clone: %s", strerror(errno));
		close(p[0]);
		rm_cgroups(g_count);
		return -1;
	}
	unsigned char b = 0;
	ssize_t n = read(p[0], &b, 1);
	close(p[0]);
	if (g_count == g_cap) {
		g_cap = g_cap ? g_cap * 2 : 1024;
		g_pids = realloc(g_pids, g_cap * sizeof *g_pids);
	}
	g_pids[g_count++] = pid; /* counted even if it failed: the cleanup reaps it */
	if (n != 1 || b != '1') {
		snprintf(err, errlen, "holder set-up: %s", n == 1 ? strerror(b) : "no answer");
		return -1;
	}
	return 0;
}

static void clean_up(void)
{
	for (size_t i = 0; i < g_count; i++)
		kill(g_pids[i], SIGKILL);
	for (size_t i = 0; i < g_count; i++)
		waitpid(g_pids[i], NULL, 0);
	for (size_t i = 0; i < g_count; i++)
		rm_cgroups(i);
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: holder_probe PARENT...\n");
		return 2;
	}
	g_parents = argv + 1;
	g_nparents = argc - 1;
	setvbuf(stdout, NULL, _IOLBF, 0);
	char line[256];
	while (fgets(line, sizeof line, stdin)) {
		unsigned long k;
		if (sscanf(line, "add %lu", &k) != 1) {
			printf("error unknown request\n");
			continue;
		}
		char err[8192] = "";
		int bad = 0;
		for (unsigned long i = 0; i < k && !bad; i++)
			bad = add_one(err, sizeof err) < 0;
		if (bad)
			printf("error %s\n", err);
		else
			printf("ok %zu\n", g_count);
	}
	clean_up();
	return 0;
}
