// inline_cxx.cpp: C++ methods and templates inlined into hot loops (member functions, a
// function template, a lambda through std::accumulate), for the inline-frame oracle
// (tests/differential/test_inline_oracle.py). Built -O2 -g.
#include <cstdio>
#include <numeric>
#include <vector>

namespace shapes {

struct Acc {
    double v = 0;
    inline __attribute__((always_inline)) void add(double x)
    {
        for (int k = 0; k < 30; k++)
            v = v * 0.999 + x;
    }
};

template <typename T>
inline __attribute__((always_inline)) T scale(T x, int i)
{
    Acc a;
    a.add(static_cast<double>(x) + i);
    return static_cast<T>(a.v * 0.5);
}

class Grid {
public:
    explicit Grid(int n) : cells(static_cast<size_t>(n), 1.0) {}
    __attribute__((noinline)) double sweep(int rounds)
    {
        double s = 0;
        for (int r = 0; r < rounds; r++)
            for (size_t i = 0; i < cells.size(); i++) {
                s += scale(cells[i], static_cast<int>(i));
                cells[i] = cells[i] * 0.5 + 1e-9 * s;  // state: no call is hoisted
            }
        return s;
    }
    __attribute__((noinline)) double total() const
    {
        return std::accumulate(cells.begin(), cells.end(), 0.0,
                               [](double a, double b) { return scale(a, 1) + b; });
    }

private:
    std::vector<double> cells;
};

}  // namespace shapes

int main()
{
    shapes::Grid g(20000);
    double t = 0;
    for (int r = 0; r < 60; r++) {
        t += g.sweep(3);
        t += g.total();
    }
    std::printf("%f\n", t);
    return 0;
}
