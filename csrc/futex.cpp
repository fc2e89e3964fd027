// Platform layer of futex.h: the Linux futex syscall, or a polling fallback.
#include "futex.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace loraplex {

namespace {

// Where the low 32 bits of a 64-bit word live.
uint32_t* low_half(std::atomic<uint64_t>* word) {
    auto* base = reinterpret_cast<uint32_t*>(word);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return base + 1;
#else
    return base;
#endif
}

}  // namespace

Deadline::Deadline(double timeout_ms) : infinite_(!(timeout_ms >= 0.0)), at_() {
    if (infinite_) {
        return;
    }
    // Clamp absurd timeouts (a year) so the nanosecond conversion cannot overflow.
    const double ms = std::min(timeout_ms, 365.0 * 24 * 3600 * 1000);
    at_ = std::chrono::steady_clock::now() +
          std::chrono::nanoseconds(static_cast<int64_t>(std::llround(ms * 1e6)));
}

int64_t Deadline::remaining_ns() const {
    if (infinite_) {
        return -1;
    }
    const auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(at_ - std::chrono::steady_clock::now());
    return left.count() > 0 ? left.count() : 0;
}

#if defined(__linux__)

Sleep sleep_on_low32(std::atomic<uint64_t>* word, uint32_t expected, int64_t max_ns) {
    struct timespec ts;
    struct timespec* timeout = nullptr;
    if (max_ns >= 0) {
        ts.tv_sec = static_cast<time_t>(max_ns / 1000000000);
        ts.tv_nsec = static_cast<long>(max_ns % 1000000000);
        timeout = &ts;
    }
    // FUTEX_WAIT takes a relative timeout measured on CLOCK_MONOTONIC.
    const long rc = syscall(SYS_futex, low_half(word), FUTEX_WAIT, expected, timeout, nullptr, 0);
    if (rc == 0) {
        return Sleep::kWoken;
    }
    switch (errno) {
        case EAGAIN:
            return Sleep::kValueDiffers;
        case ETIMEDOUT:
            return Sleep::kTimedOut;
        case EINTR:
            return Sleep::kInterrupted;
        default:
            // EFAULT/EINVAL cannot happen for a checked, mapped, aligned word; treat
            // anything else as a spurious return so the caller re-checks and retries.
            return Sleep::kWoken;
    }
}

int wake_all(std::atomic<uint64_t>* word) {
    const long rc = syscall(SYS_futex, low_half(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    return rc < 0 ? 0 : static_cast<int>(rc);
}

#else  // no futex: poll in short naps

Sleep sleep_on_low32(std::atomic<uint64_t>* word, uint32_t expected, int64_t max_ns) {
    if (low32(word->load(std::memory_order_acquire)) != expected) {
        return Sleep::kValueDiffers;
    }
    constexpr int64_t kNapNs = 50000;  // 50 us: latency bound of a wake on these hosts
    if (max_ns == 0) {
        return Sleep::kTimedOut;
    }
    const int64_t nap = (max_ns < 0 || max_ns > kNapNs) ? kNapNs : max_ns;
    std::this_thread::sleep_for(std::chrono::nanoseconds(nap));
    return nap == max_ns ? Sleep::kTimedOut : Sleep::kWoken;
}

int wake_all(std::atomic<uint64_t>*) { return 0; }

#endif

}  // namespace loraplex
