/* The floor under an exec, run inside a sandbox by bench/exec_floor.py: starts
 * `sh -c true` with posix_spawn (glibc: clone(CLONE_VM|CLONE_VFORK), as the agent's
 * supervisor does) and waits for it, N times, and prints each round trip in
 * nanoseconds, one per line. What the kernel costs for a command in this sandbox
 * (its namespaces, cgroups, seccomp filter and overlay), without the agent's protocol
 * or any client. Usage: spawn_probe N [shell]. */
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>

extern char **environ;

int main(int argc, char **argv)
{
	long n = argc > 1 ? atol(argv[1]) : 100;
	const char *shell = argc > 2 ? argv[2] : "/bin/sh";
	char *child[] = {"sh", "-c", "true", NULL};
	for (long i = 0; i < n; i++) {
		struct timespec a, b;
		pid_t pid;
		int st;
		clock_gettime(CLOCK_MONOTONIC, &a);
		if (posix_spawn(&pid, shell, NULL, NULL, child, environ) != 0)
			return 2;
		if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
			return 3;
		clock_gettime(CLOCK_MONOTONIC, &b);
		printf("%lld\n", (long long)(b.tv_sec - a.tv_sec) * 1000000000LL + (b.tv_nsec - a.tv_nsec));
	}
	return 0;
}
