/*
 * A minimal JIT writing a jitdump (tools/perf/Documentation/jitdump-specification.txt) in its
 * working directory, mapped executable as perf's jit_detect looks for it: one page of
 * anonymous executable memory holds a frame-pointer function that spins; it is loaded as
 * "jit_phase_a" and run for argv[1] seconds of CPU (default 0.7), then loaded again at the
 * same address as "jit_phase_b" and run as long. Each record is flushed before the code it
 * names runs. The CLOCK_MONOTONIC ns of the second load is written to phase-b-<pid>.ns.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* push rbp; mov rbp,rsp; mov rcx,rdi; 1: dec rcx; jnz 1b; pop rbp; ret */
static const unsigned char CODE[] = {0x55, 0x48, 0x89, 0xe5, 0x48, 0x89, 0xf9, 0x48, 0xff,
                                     0xc9, 0x75, 0xfb, 0x5d, 0xc3};

static FILE *dump;
static uint64_t index_;

static void put(const void *p, size_t n) { fwrite(p, n, 1, dump); }

static void load(void *addr, const char *name, uint64_t t)
{
    uint32_t id = 0, size, pid = getpid(), tid = syscall(SYS_gettid);
    uint64_t vma = (uint64_t)(uintptr_t)addr, csize = sizeof CODE;
    size = 16 + 40 + strlen(name) + 1 + sizeof CODE;
    put(&id, 4); put(&size, 4); put(&t, 8);
    put(&pid, 4); put(&tid, 4); put(&vma, 8); put(&vma, 8); put(&csize, 8); put(&index_, 8);
    put(name, strlen(name) + 1);
    put(CODE, sizeof CODE);
    index_++;
    fflush(dump);
}

static void spin(void (*f)(long), double secs)
{
    uint64_t end = cpu_ns() + (uint64_t)(secs * 1e9);
    while (cpu_ns() < end)
        f(2000000);
}

int main(int argc, char **argv)
{
    double secs = argc > 1 ? atof(argv[1]) : 0.7;
    char path[64];
    snprintf(path, sizeof path, "jit-%d.dump", (int)getpid());
    dump = fopen(path, "w+");
    if (!dump)
        return 1;
    struct {
        uint32_t magic, version, total_size, elf_mach, pad1, pid;
        uint64_t timestamp, flags;
    } h = {0x4A695444, 1, 40, 62, 0, (uint32_t)getpid(), now_ns(), 0};
    put(&h, sizeof h);
    fflush(dump);
    /* the marker perf looks for: the dump mapped executable */
    void *marker = mmap(NULL, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fileno(dump), 0);
    if (marker == MAP_FAILED)
        return 1;
    unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
                               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (code == MAP_FAILED)
        return 1;
    memcpy(code, CODE, sizeof CODE);
    void (*f)(long) = (void (*)(long))code;
    load(code, "jit_phase_a", now_ns());
    spin(f, secs);
    uint64_t tb = now_ns();
    load(code, "jit_phase_b", tb);
    spin(f, secs);
    uint32_t close_id = 3, csz = 16;
    uint64_t t = now_ns();
    put(&close_id, 4); put(&csz, 4); put(&t, 8);
    fclose(dump);
    snprintf(path, sizeof path, "phase-b-%d.ns", (int)getpid());
    FILE *out = fopen(path, "w");
    if (!out)
        return 1;
    fprintf(out, "%llu\n", (unsigned long long)tb);
    return fclose(out) != 0;
}
