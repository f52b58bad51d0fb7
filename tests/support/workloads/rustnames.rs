// The Rust naming workload (tests/support/rustbuild.py builds it with each symbol mangling):
// its hot functions have non-trivial paths, so their demangled names exercise the demangler:
// nested modules, a generic struct's trait impl instantiated twice (Wheel<u8>, Wheel<u32>), a
// generic function instantiated with a closure, and the closure itself. Built at opt-level 0,
// every one of them stays a function of its own. argv[1]: rounds (about 3 ms each).
// (std::hint::black_box is newer than Debian's rustc 1.63: a volatile read stands for it)
#[inline(never)]
fn black_box<T: Copy>(x: T) -> T {
    unsafe { std::ptr::read_volatile(&x) }
}

pub mod outer {
    pub mod inner {
        pub trait Spin {
            fn spin(&self, n: u64) -> u64;
        }

        pub struct Wheel<T> {
            pub seed: T,
        }

        impl<T: Copy + Into<u64>> Spin for Wheel<T> {
            #[inline(never)]
            fn spin(&self, n: u64) -> u64 {
                let mut acc: u64 = self.seed.into();
                for i in 0..n {
                    acc = acc.wrapping_mul(6364136223846793005).wrapping_add(i);
                }
                crate::black_box(acc)
            }
        }

        #[inline(never)]
        pub fn churn<F: Fn(u64) -> u64>(f: F, n: u64) -> u64 {
            let mut acc = 0u64;
            for i in 0..n {
                acc ^= f(i);
            }
            acc
        }
    }
}

use outer::inner::{churn, Spin, Wheel};

#[inline(never)]
fn run_all(rounds: u64) -> u64 {
    let w8 = Wheel { seed: 7u8 };
    let w32 = Wheel { seed: 9u32 };
    let mut total = 0u64;
    for _ in 0..rounds {
        total ^= w8.spin(black_box(200_000));
        total ^= w32.spin(black_box(200_000));
        total ^= churn(|x| black_box(x).rotate_left(7) ^ total, black_box(200_000));
    }
    total
}

fn main() {
    let rounds: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(100);
    println!("{}", run_all(rounds));
}
