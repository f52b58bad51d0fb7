// C++ under a call chain: throw/catch in a loop (so the samples cross libstdc++'s __cxa_throw
// and libgcc_s's _Unwind_RaiseException), std::sort with a lambda, and member functions with
// parameter lists, so perf prints demangled names with parentheses and "::".
//
// argv[1]: rounds (default 30).  Fixed work, no clock calls.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <vector>

#define NOIN __attribute__((noinline, noclone))

namespace oracle {

volatile std::uint64_t sink;

struct Boom : std::runtime_error {
    explicit Boom(int v) : std::runtime_error("boom"), value(v) {}
    int value;
};

class Worker {
public:
    explicit Worker(int seed) : seed_(seed) {}
    NOIN int thrower(int depth) const;
    NOIN int catcher(int n) const;
    NOIN std::uint64_t sorter(std::vector<std::uint32_t> &v) const;
    NOIN std::uint64_t run(int rounds) const;

private:
    int seed_;
};

NOIN int Worker::thrower(int depth) const
{
    if (depth == 0)
        throw Boom(seed_);
    return thrower(depth - 1) + 1;
}

NOIN int Worker::catcher(int n) const
{
    int caught = 0;
    for (int i = 0; i < n; i++) {
        try {
            thrower(4);
        } catch (const Boom &e) {
            caught += e.value;
        }
    }
    return caught;
}

NOIN std::uint64_t Worker::sorter(std::vector<std::uint32_t> &v) const
{
    std::uint32_t x = static_cast<std::uint32_t>(seed_);
    for (auto &e : v) {
        x = x * 1664525u + 1013904223u;
        e = x;
    }
    std::sort(v.begin(), v.end(), [](std::uint32_t a, std::uint32_t b) {
        return (a ^ 0x5bd1e995u) < (b ^ 0x5bd1e995u);
    });
    return v.front();
}

NOIN std::uint64_t Worker::run(int rounds) const
{
    std::vector<std::uint32_t> v(200000);
    std::uint64_t acc = 0;
    for (int r = 0; r < rounds; r++) {
        acc += static_cast<std::uint64_t>(catcher(3000));
        acc += sorter(v);
    }
    return acc;
}

}  // namespace oracle

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? std::atoi(argv[1]) : 30;
    oracle::Worker w(7);
    oracle::sink = w.run(rounds);
    return 0;
}
