// Bounded waits on 64-bit words built on futex.h (pybind11-free).
// Run with the GIL released; the only way back into Python is the optional
// interrupt check, which the caller supplies to honour signals (Ctrl-C).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>

#include "futex.h"

namespace loraplex {

enum class WaitResult { kSatisfied, kTimedOut, kInterrupted };

// How a wait stays responsive to signals: after an EINTR, and at least every
// `slice_ns` of sleep (when positive), `check()` runs; true abandons the wait
// (kInterrupted). An empty check means signals never end a wait.
struct InterruptCheck {
    std::function<bool()> check;
    int64_t slice_ns = -1;
};

// Return once the low 32 bits of *word differ from `expected`.
WaitResult wait_while_low32_equals(std::atomic<uint64_t>* word, uint32_t expected, const Deadline& deadline,
                                   const InterruptCheck& interrupts);

// Return once *word >= target (unsigned): spin re-reading the word for up to
// `spin_ns` (less when this thread's recent spins ran out: see waits.cpp), then
// sleep on its futex, re-reading after every wake.
WaitResult wait_until_at_least(std::atomic<uint64_t>* word, uint64_t target, const Deadline& deadline,
                               int64_t spin_ns, const InterruptCheck& interrupts);

}  // namespace loraplex
