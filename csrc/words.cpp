// Buffer checks for WordRef (see words.h).
#include "words.h"

#include <stdexcept>

namespace loraplex {

WordRef::WordRef(const py::buffer& buf, py::ssize_t index)
    : info_(buf.request(/*writable=*/true)), word_(nullptr) {
    // Any C-contiguous buffer is accepted; its total byte size is what counts. A strided
    // view (a[:, 0], mv[::-1]) would map word `index` outside the elements it exposes.
    py::ssize_t expect = info_.itemsize;
    for (py::ssize_t d = info_.ndim - 1; d >= 0 && info_.size > 0; --d) {
        if (info_.shape[d] != 1 && info_.strides[d] != expect) {
            throw std::invalid_argument("buffer is not C-contiguous");
        }
        expect *= info_.shape[d];
    }
    const py::ssize_t nbytes = info_.size * info_.itemsize;
    // Compare in words: (index + 1) * 8 overflows for huge indices and wraps back into range.
    if (index < 0 || index >= nbytes / static_cast<py::ssize_t>(sizeof(uint64_t))) {
        throw py::index_error("word index out of range for buffer");
    }
    auto addr = reinterpret_cast<uintptr_t>(info_.ptr) + static_cast<uintptr_t>(index) * sizeof(uint64_t);
    if (addr % alignof(std::atomic<uint64_t>) != 0) {
        throw std::invalid_argument("buffer is not 8-byte aligned");
    }
    word_ = reinterpret_cast<std::atomic<uint64_t>*>(addr);
}

}  // namespace loraplex
