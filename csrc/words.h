// Buffers seen as arrays of 64-bit atomic words (shared by every binding in _C).
// Owns the checks that make a Python buffer safe to treat as words: writable,
// C-contiguous, index in range, 8-byte aligned. Never releases the GIL itself.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>

namespace loraplex {

namespace py = pybind11;

static_assert(sizeof(std::atomic<uint64_t>) == sizeof(uint64_t), "lock-free 64-bit atomics required");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "cross-process words need lock-free atomics");

// One checked word of a buffer, holding the buffer export for as long as it
// lives: while a WordRef exists the exporter (mmap, bytearray, memoryview)
// refuses to close or resize, so a wait with the GIL released cannot be left
// pointing into unmapped memory. Destroy it with the GIL held.
class WordRef {
public:
    WordRef(const py::buffer& buf, py::ssize_t index);

    std::atomic<uint64_t>* get() const { return word_; }
    std::atomic<uint64_t>* operator->() const { return word_; }

private:
    py::buffer_info info_;
    std::atomic<uint64_t>* word_;
};

}  // namespace loraplex
