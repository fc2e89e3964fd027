// loraplex._C: native primitives on words in shared memory.
// Owns cross-process atomics, futex waits and wakes used by the CPU-assist
// protocol (DESIGN §5); never allocates shared memory itself and never holds
// the GIL while it waits. Bindings only: checks live in words.cpp, the futex
// scheme in futex.h, the wait loops in waits.cpp.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <utility>

#include "cuda_stream_ops.h"
#include "futex.h"
#include "waits.h"
#include "words.h"

namespace py = pybind11;
using loraplex::WordRef;

namespace {

// Longest kernel sleep of the main thread between checks for Python signals.
constexpr int64_t kSignalSliceNs = 100 * 1000 * 1000;
// Longest spin we honour (1 s); longer requests are clamped.
constexpr double kMaxSpinUs = 1e6;

unsigned long g_main_thread = 0;

// Signals are only handled on Python's main thread: waits there sleep in
// slices and run pending handlers (KeyboardInterrupt ends the wait).
loraplex::InterruptCheck interrupts_for_this_thread() {
    loraplex::InterruptCheck ic;
    if (PyThread_get_thread_ident() == g_main_thread) {
        ic.check = [] {
            py::gil_scoped_acquire gil;
            return PyErr_CheckSignals() != 0;
        };
        ic.slice_ns = kSignalSliceNs;
    }
    return ic;
}

loraplex::Deadline deadline_from(double timeout_ms) {
    if (std::isnan(timeout_ms)) {
        throw std::invalid_argument("timeout_ms must be a number (negative waits without a timeout)");
    }
    return loraplex::Deadline(timeout_ms);
}

bool finish(loraplex::WaitResult result) {
    if (result == loraplex::WaitResult::kInterrupted) {
        throw py::error_already_set();  // the signal handler's exception (e.g. KeyboardInterrupt)
    }
    return result == loraplex::WaitResult::kSatisfied;
}

bool futex_wait(const py::buffer& buf, py::ssize_t index, uint64_t expected, double timeout_ms) {
    WordRef word(buf, index);  // holds the buffer export across the GIL-free wait
    const loraplex::Deadline deadline = deadline_from(timeout_ms);
    const loraplex::InterruptCheck interrupts = interrupts_for_this_thread();
    loraplex::WaitResult result;
    {
        py::gil_scoped_release nogil;
        result = loraplex::wait_while_low32_equals(word.get(), loraplex::low32(expected), deadline, interrupts);
    }
    return finish(result);
}

bool wait_until_at_least(const py::buffer& buf, py::ssize_t index, uint64_t target, double timeout_ms,
                         double spin_us) {
    WordRef word(buf, index);
    if (std::isnan(spin_us) || spin_us < 0) {
        throw std::invalid_argument("spin_us must be >= 0");
    }
    const loraplex::Deadline deadline = deadline_from(timeout_ms);
    // Satisfied already: answer without giving up the GIL (the common case when spinning pays off).
    if (word->load(std::memory_order_acquire) >= target) {
        return true;
    }
    const auto spin_ns = static_cast<int64_t>(std::llround(std::min(spin_us, kMaxSpinUs) * 1000.0));
    const loraplex::InterruptCheck interrupts = interrupts_for_this_thread();
    loraplex::WaitResult result;
    {
        py::gil_scoped_release nogil;
        result = loraplex::wait_until_at_least(word.get(), target, deadline, spin_ns, interrupts);
    }
    return finish(result);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() =
        "loraplex native primitives: atomics, futex waits and wakes on 64-bit words in (shared) memory buffers.\n\n"
        "Every function takes a writable C-contiguous buffer (bytearray, mmap, memoryview over shared memory,\n"
        "numpy array) and a word index counted in 64-bit words; the word must lie inside the buffer and be\n"
        "8-byte aligned. Futexes are process-shared and sleep on the word's low 32 bits; waits compare the\n"
        "full 64-bit value in a loop and release the GIL.";
    g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();

    m.def(
        "atomic_load",
        [](const py::buffer& buf, py::ssize_t index) { return WordRef(buf, index)->load(std::memory_order_acquire); },
        py::arg("buf"), py::arg("index"), "Atomically read 64-bit word `index` of a writable buffer.");
    m.def(
        "atomic_store",
        [](const py::buffer& buf, py::ssize_t index, uint64_t value) {
            WordRef(buf, index)->store(value, std::memory_order_seq_cst);
        },
        py::arg("buf"), py::arg("index"), py::arg("value"),
        "Atomically write `value` to 64-bit word `index` (no wake: see store_and_wake).");
    m.def(
        "atomic_fetch_add",
        [](const py::buffer& buf, py::ssize_t index, uint64_t value) {
            return WordRef(buf, index)->fetch_add(value, std::memory_order_acq_rel);
        },
        py::arg("buf"), py::arg("index"), py::arg("value"),
        "Atomically add value to 64-bit word `index` of a writable buffer; return the previous value.");
    m.def(
        "atomic_compare_exchange",
        [](const py::buffer& buf, py::ssize_t index, uint64_t expected, uint64_t desired) {
            uint64_t observed = expected;
            const bool swapped = WordRef(buf, index)->compare_exchange_strong(observed, desired,
                                                                              std::memory_order_seq_cst);
            return std::pair<bool, uint64_t>(swapped, observed);
        },
        py::arg("buf"), py::arg("index"), py::arg("expected"), py::arg("desired"),
        "If word `index` equals `expected`, set it to `desired`. Returns (success, observed): the value\n"
        "found, equal to `expected` exactly when the swap happened.");
    m.def("futex_wait", &futex_wait, py::arg("buf"), py::arg("index"), py::arg("expected"), py::arg("timeout_ms"),
          "Sleep while the low 32 bits of word `index` equal `expected & 0xffffffff`. True once they differ\n"
          "(at once if they already do); False if `timeout_ms` passes first (negative: no timeout). A wake\n"
          "that leaves the word unchanged does not end the wait. The GIL is released while waiting; on the\n"
          "main thread pending signal handlers run and their exception ends the wait.");
    m.def(
        "futex_wake",
        [](const py::buffer& buf, py::ssize_t index) { return loraplex::wake_all(WordRef(buf, index).get()); },
        py::arg("buf"), py::arg("index"),
        "Wake every thread and process sleeping on word `index`; return how many woke (0 without futexes).");
    m.def("wait_until_at_least", &wait_until_at_least, py::arg("buf"), py::arg("index"), py::arg("target"),
          py::arg("timeout_ms"), py::arg("spin_us") = 50.0,
          "Return True once word `index` >= `target` (unsigned 64-bit), False if `timeout_ms` passes first\n"
          "(negative: no timeout). Spins re-reading the word for up to `spin_us` microseconds (less on a\n"
          "thread whose recent spins ran out: spinning only helps when the awaited process has its own core),\n"
          "then sleeps on its futex. The GIL is released while waiting.");
    m.def(
        "store_and_wake",
        [](const py::buffer& buf, py::ssize_t index, uint64_t value) {
            WordRef word(buf, index);
            word->store(value, std::memory_order_seq_cst);
            loraplex::wake_all(word.get());
        },
        py::arg("buf"), py::arg("index"), py::arg("value"),
        "Atomically write `value` to word `index`, then wake all its waiters.");
    m.def(
        "add_and_wake",
        [](const py::buffer& buf, py::ssize_t index, uint64_t value) {
            WordRef word(buf, index);
            const uint64_t previous = word->fetch_add(value, std::memory_order_seq_cst);
            loraplex::wake_all(word.get());
            return previous;
        },
        py::arg("buf"), py::arg("index"), py::arg("value"),
        "Atomically add `value` to word `index`, wake all its waiters, and return the previous value.");
    m.def(
        "cuda_stream_ops_unavailable", [] { return loraplex::cuda_stream_ops_unavailable(); },
        "Empty when the CUDA driver's stream memory operations can be used, else the reason.");
    m.def(
        "cuda_launch_store_and_wake",
        [](uintptr_t stream, const py::buffer& buf, py::ssize_t index, uint64_t value) {
            WordRef word(buf, index);  // the segment stays mapped for the engine's life
            loraplex::launch_store_and_wake(stream, word.get(), value);
        },
        py::arg("stream"), py::arg("buf"), py::arg("index"), py::arg("value"),
        "Stream-ordered: when `stream` reaches this point, store `value` into word `index` and wake its "
        "waiters (from a driver thread); the caller never blocks.");
    m.def(
        "cuda_word_device_pointer",
        [](const py::buffer& buf, py::ssize_t index) {
            WordRef word(buf, index);
            return loraplex::device_pointer(reinterpret_cast<uintptr_t>(word.get()));
        },
        py::arg("buf"), py::arg("index"), "Device address of word `index` of host-registered memory.");
    m.def(
        "cuda_stream_wait_at_least",
        [](uintptr_t stream, uintptr_t device_address, uint64_t value) {
            loraplex::stream_wait_at_least(stream, device_address, value);
        },
        py::arg("stream"), py::arg("device_address"), py::arg("value"),
        "Make `stream` wait (on the GPU, not the host) until the 64-bit word at `device_address` >= value.");
    m.def(
        "has_futex",
        [] {
#if defined(__linux__)
            return true;
#else
            return false;
#endif
        },
        "True where waits sleep on a kernel futex; False where they fall back to polling in short naps.");
}
