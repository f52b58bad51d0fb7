/* arch.c: the register model of each supported architecture (struct unw_arch_desc,
 * unwcore_int.h), shared by the CFI compiler and the unwinder.
 *
 * Rules:
 *   - A descriptor is the whole register model: which DWARF columns are sp, fp and the return
 *     address, where each DWARF register sits in perf's REGS_USER dump, which columns a
 *     compiled rule carries (callee-saved) and the kernel signal frame's layout. Nothing else
 *     in the compiler or unwinder names a register.
 *   - Constant data, no state: unw_arch is O(1) and safe from any thread.
 */
#include "unwcore_int.h"

static const struct unw_arch_desc ARCH_X86_64 = {
    .id = UNW_ARCH_X86_64,
    .ndwarf = 17,
    .sp = 7, .fp = 6, .ra = 16,
    .perf_ip = 8,
    /* System V AMD64 ABI fig. 3.36 DWARF numbering -> perf arch/x86/include/uapi/asm/perf_regs.h:
     * rax rdx rcx rbx rsi rdi rbp rsp r8..r15 RA(rip) */
    .dwarf_to_perf = {0, 3, 2, 1, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23, 8,
                      -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    /* System V AMD64 ABI 3.2.1: rbx, rbp, r12-r15 are callee-saved (plus the RA column) */
    .nsaved = 7,
    .saved = {6, 16, 3, 12, 13, 14, 15},
    .slot_of = {-1, -1, -1, 2, -1, -1, 0, -1, -1, -1, -1, -1, 3, 4, 5, 6, 1,
                -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
    /* Linux x86_64 rt_sigframe: the handler's `ret` pops pretcode, so at __restore_rt rsp points
     * at the struct ucontext (arch/x86/include/asm/sigframe.h); uc_mcontext is at +40 (uc_flags,
     * uc_link, 24-byte stack_t), and struct sigcontext_64 (arch/x86/include/uapi/asm/
     * sigcontext.h) holds r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp, rip, 8 bytes each.
     * glibc's __restore_rt CFI says the same (libc_sigaction.c do_expr(oRBP ...)). */
    .sigctx_off = {144, 136, 152, 128, 112, 104, 120, 160, 40, 48, 56, 64, 72, 80, 88, 96, 168,
                   -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1},
};

const struct unw_arch_desc *unw_arch(int id)
{
    return id == UNW_ARCH_X86_64 ? &ARCH_X86_64 : NULL;
}
