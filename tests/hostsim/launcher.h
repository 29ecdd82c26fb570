// Entry points of a host-simulated kernel library (tests/hostsim): each kernel behind one signature, void*
// arguments in the kernel's order (scalars by pointer), looked up by its source-level name. Included after the
// kernel source; the including unit defines gemv_entry (from the kernels' declared parameters), `entries` and
// `entry_count`.
#pragma once

inline void quantize_entry(void* const* a) {
    quantize_activations((const float*)a[0], *(const int*)a[1], *(const int*)a[2], (signed char*)a[3], (float*)a[4],
                         (int*)a[5]);
}

struct Entry {
    const char* name;
    hostsim::Kernel run;
};
extern const Entry entries[];
extern const int entry_count;

extern "C" int hostsim_launch(const char* name, unsigned gx, unsigned gy, unsigned bx, unsigned by,
                              unsigned long shared, void* const* args) {
    for (int i = 0; i < entry_count; ++i)
        if (!std::strcmp(entries[i].name, name))
            return hostsim::launch(entries[i].run, dim3{gx, gy, 1}, dim3{bx, by, 1}, shared, args);
    return 1;
}
