// Test stub: the one CUDA type allocd_torch/_hooks.cpp uses.
#pragma once
typedef struct CUstream_st* cudaStream_t;
