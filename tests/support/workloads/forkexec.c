/* A parent that forks two children; each execs argv[1] with the remaining arguments, and
 * the parent spins in parent_spin while they run, then reaps them. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define NOIN __attribute__((noipa))

volatile uint64_t sink;

NOIN uint64_t parent_spin(uint64_t n)
{
    uint64_t acc = n;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 29;
    }
    return acc;
}

int main(int argc, char **argv)
{
    if (argc < 2) { fprintf(stderr, "usage: forkexec PROG [ARGS...]\n"); return 2; }
    pid_t kids[2];
    for (int i = 0; i < 2; i++) {
        kids[i] = fork();
        if (kids[i] < 0) { perror("fork"); return 1; }
        if (kids[i] == 0) {
            execv(argv[1], &argv[1]);
            perror("execv");
            _exit(127);
        }
    }
    sink += parent_spin(20000000);
    int bad = 0;
    for (int i = 0; i < 2; i++) {
        int st;
        if (waitpid(kids[i], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) bad = 1;
    }
    return bad;
}
