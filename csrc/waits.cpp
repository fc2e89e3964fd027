// Wait loops of waits.h.
#include "waits.h"

#include <algorithm>
#include <chrono>

namespace loraplex {

namespace {

// Adaptive spinning. A spin only pays when the awaited process runs on another core;
// when processes outnumber cores it occupies the very core that process needs, and
// every round trip grows by the whole spin. So each thread keeps a spin budget:
// halved when a spin runs out, doubled when one succeeds, between kMinSpinNs and
// the caller's spin_us. (Yielding between polls instead looked equivalent on an idle
// host, but under CPU load EEVDF charges every sched_yield as a used slice and the
// yielder then waits milliseconds to run again after its futex wake.)
constexpr int64_t kMinSpinNs = 2000;
thread_local int64_t t_spin_budget_ns = -1;  // -1: no spin yet on this thread

// One kernel sleep bounded by the deadline and the interrupt slice; returns
// kInterrupted if the caller must abandon, else kSatisfied to mean "re-check".
WaitResult sleep_once(std::atomic<uint64_t>* word, uint32_t expected, int64_t left_ns,
                      const InterruptCheck& interrupts) {
    int64_t max_ns = left_ns;
    const bool sliced = interrupts.check && interrupts.slice_ns > 0 && (max_ns < 0 || max_ns > interrupts.slice_ns);
    if (sliced) {
        max_ns = interrupts.slice_ns;
    }
    const Sleep result = sleep_on_low32(word, expected, max_ns);
    const bool slice_over = sliced && result == Sleep::kTimedOut;
    if ((result == Sleep::kInterrupted || slice_over) && interrupts.check && interrupts.check()) {
        return WaitResult::kInterrupted;
    }
    return WaitResult::kSatisfied;
}

}  // namespace

WaitResult wait_while_low32_equals(std::atomic<uint64_t>* word, uint32_t expected, const Deadline& deadline,
                                   const InterruptCheck& interrupts) {
    for (;;) {
        if (low32(word->load(std::memory_order_acquire)) != expected) {
            return WaitResult::kSatisfied;
        }
        const int64_t left = deadline.remaining_ns();
        if (left == 0) {
            return WaitResult::kTimedOut;
        }
        if (sleep_once(word, expected, left, interrupts) == WaitResult::kInterrupted) {
            return WaitResult::kInterrupted;
        }
    }
}

WaitResult wait_until_at_least(std::atomic<uint64_t>* word, uint64_t target, const Deadline& deadline,
                               int64_t spin_ns, const InterruptCheck& interrupts) {
    uint64_t value = word->load(std::memory_order_acquire);
    if (value >= target) {
        return WaitResult::kSatisfied;
    }
    if (spin_ns > 0) {
        // This thread's budget: what recent spins earned, never more than the caller allows.
        int64_t spin = t_spin_budget_ns < 0 ? spin_ns : std::min(spin_ns, t_spin_budget_ns);
        const int64_t left = deadline.remaining_ns();
        const bool deadline_bound = left >= 0 && left < spin;
        if (deadline_bound) {
            spin = left;
        }
        const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin);
        do {
            for (int k = 0; k < 16; ++k) {  // read the clock every 16 polls, not every one
                if (word->load(std::memory_order_acquire) >= target) {
                    if (!deadline_bound) {
                        t_spin_budget_ns = std::min(spin_ns, std::max(kMinSpinNs, 2 * spin));
                    }
                    return WaitResult::kSatisfied;
                }
                cpu_relax();
            }
        } while (std::chrono::steady_clock::now() < until);
        if (!deadline_bound) {
            t_spin_budget_ns = std::max(kMinSpinNs, spin / 2);
        }
    }
    for (;;) {
        value = word->load(std::memory_order_acquire);
        if (value >= target) {
            return WaitResult::kSatisfied;
        }
        const int64_t left = deadline.remaining_ns();
        if (left == 0) {
            return WaitResult::kTimedOut;
        }
        // Sleeps only while the low half still reads as `value`: a store or add made
        // between our read and the kernel's check makes the sleep return at once.
        if (sleep_once(word, low32(value), left, interrupts) == WaitResult::kInterrupted) {
            return WaitResult::kInterrupted;
        }
    }
}

}  // namespace loraplex
