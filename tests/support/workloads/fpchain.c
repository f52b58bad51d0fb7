/* main -> a -> b -> {spin, zero}, built with frame pointers (-O2 -fno-omit-frame-pointer) for
 * the frame-pointer callchain tests (tests/differential/test_callchain_replay.py): the kernel's
 * user callchain walk (perf record -g) follows rbp, so every frame of ours is in it.
 *
 * spin is user time; zero reads /dev/zero (kernel time in the read syscall), so callchains
 * have a kernel part and a user part. Fixed work, not wall time: argv[1] rounds (default 40).
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define NOIN __attribute__((noinline, noclone))

volatile uint64_t sink;
static char buf[1 << 20];

NOIN uint64_t spin(uint64_t n)
{
    uint64_t acc = sink;
    for (uint64_t i = 0; i < n; i++) {
        acc = acc * 6364136223846793005ULL + i;
        acc ^= acc >> 29;
    }
    return acc;
}

NOIN uint64_t zero(int fd, int times)
{
    uint64_t got = 0;
    for (int i = 0; i < times; i++) {
        ssize_t n = read(fd, buf, sizeof buf);
        got += n > 0 ? (uint64_t)n : 0;
    }
    return got + (uint8_t)buf[4095];
}

NOIN uint64_t b(int fd, uint64_t n)
{
    return spin(n) + zero(fd, 40);
}

NOIN uint64_t a(int fd, uint64_t n)
{
    return b(fd, n) + 1;
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 40;
    int fd = open("/dev/zero", O_RDONLY);
    if (fd < 0)
        return 1;
    for (int r = 0; r < rounds; r++)
        sink += a(fd, 2000000);
    close(fd);
    return 0;
}
