// Kernel sleep/wake on the low 32-bit half of a 64-bit word (pybind11-free).
//
// Scheme: Linux futexes are 32-bit, our sequence words are 64-bit. A waiter
// reads the whole 64-bit word, decides it must sleep, and sleeps on the futex
// at the address of the word's LOW 32 bits (the word's own address on
// little-endian hosts, +4 on big-endian) with that half as the expected value.
// A waker changes the word (64-bit atomic store or add) and then wakes that
// same address. The kernel only compares 32 bits, so callers loop: after every
// return they re-read the full 64-bit value and decide again. A change that
// leaves the low half equal (a jump by an exact multiple of 2^32 between the
// waiter's read and its sleep) is seen only at the next wake or timeout;
// sequence and done words advance in small steps, so this never happens in
// the protocol. Futexes are SHARED (no FUTEX_PRIVATE_FLAG): waiters and
// wakers are different processes mapping the same segment.
//
// Other OSes: no futex; sleep_on_low32 naps for a short slice and wake_all
// wakes nobody, so waits become spin-then-poll loops (correct, slower).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace loraplex {

enum class Sleep {
    kWoken,         // returned after a wake, or spuriously: re-check the word
    kValueDiffers,  // the low half already differed from `expected`: no sleep
    kTimedOut,      // max_ns passed
    kInterrupted,   // a signal arrived (EINTR): check for Python signals
};

// Sleep while the low 32 bits of *word equal `expected`, for at most `max_ns`
// nanoseconds (negative: no limit). May return early; callers loop.
Sleep sleep_on_low32(std::atomic<uint64_t>* word, uint32_t expected, int64_t max_ns);

// Wake every process and thread sleeping on `word`; returns how many woke
// (always 0 where there is no futex: pollers notice the change themselves).
int wake_all(std::atomic<uint64_t>* word);

inline uint32_t low32(uint64_t value) { return static_cast<uint32_t>(value & 0xffffffffu); }

// Hint to the CPU that we are in a spin loop (lets the sibling hyperthread run).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    asm volatile("yield" ::: "memory");
#else
    std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

// A point on the monotonic clock, or never (negative timeout).
class Deadline {
public:
    explicit Deadline(double timeout_ms);
    bool infinite() const { return infinite_; }
    bool passed() const { return !infinite_ && std::chrono::steady_clock::now() >= at_; }
    // Nanoseconds left, at least 0; -1 when infinite.
    int64_t remaining_ns() const;

private:
    bool infinite_;
    std::chrono::steady_clock::time_point at_;
};

}  // namespace loraplex
