// The Rust inlining workload (tests/differential/test_inline_oracle.py builds it with
// -C opt-level=2 -g): its hot loops are made of calls LLVM inlines, so samples land in inlined
// frames at several levels: an iterator chain (core::iter's map/fold, the closures given to
// them, u64::wrapping_mul) inlined into one function, and an #[inline(always)] generic method
// of a trait impl inlined into a loop of another. Each step depends on the one before, so
// no loop folds or vectorizes away. argv[1]: rounds (about 0.5 ms each).
// (std::hint::black_box is newer than Debian's rustc 1.63: a volatile read stands for it)
#[inline(never)]
fn black_box<T: Copy>(x: T) -> T {
    unsafe { std::ptr::read_volatile(&x) }
}

pub mod lcg {
    #[inline(always)]
    pub fn mix(acc: u64, x: u64) -> u64 {
        acc.wrapping_mul(6364136223846793005).wrapping_add(x)
    }

    pub trait Step {
        fn step(&mut self, x: u64) -> u64;
    }

    pub struct Gen<T> {
        pub state: T,
    }

    impl Step for Gen<u64> {
        #[inline(always)]
        fn step(&mut self, x: u64) -> u64 {
            self.state = mix(self.state, x) ^ (self.state >> 29);
            self.state
        }
    }
}

use lcg::{mix, Gen, Step};

#[inline(never)]
fn fold_all(v: &[u64]) -> u64 {
    v.iter().map(|&x| x.rotate_left(7)).fold(0u64, |a, x| mix(a, x))
}

#[inline(never)]
fn walk(n: u64) -> u64 {
    let mut g = Gen { state: black_box(3u64) };
    let mut acc = 0u64;
    for i in 0..n {
        acc ^= g.step(i);
    }
    acc
}

fn main() {
    let rounds: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let v: Vec<u64> = (0..200_000u64).map(|i| i * 2654435761).collect();
    let mut total = 0u64;
    for _ in 0..rounds {
        total = total.rotate_left(1) ^ fold_all(black_box(&v));
        total ^= walk(black_box(200_000));
    }
    println!("{}", total);
}
