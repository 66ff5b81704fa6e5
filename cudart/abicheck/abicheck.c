// abicheck prints, from CUDA's own headers, the struct layouts and enum
// values that cudart's hand-written shim (../shim.c) assumes, one name=value
// per line, with the same names as cudart.ABIAssumptions. Build and run it
// where the toolkit's headers are (cudart's TestABI does this):
//
//	gcc -I/usr/local/cuda/include -o abicheck abicheck.c && ./abicheck
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#define S(T) printf("sizeof.%s=%zu\n", #T, sizeof(T))
#define O(T, f) printf("offsetof.%s.%s=%zu\n", #T, #f, offsetof(T, f))
#define E(v) printf("%s=%lld\n", #v, (long long)(v))

int main(void) {
	S(CUmemLocation); O(CUmemLocation, type); O(CUmemLocation, id);
	S(CUmemAllocationProp); O(CUmemAllocationProp, type); O(CUmemAllocationProp, requestedHandleTypes);
	O(CUmemAllocationProp, location); O(CUmemAllocationProp, win32HandleMetaData); O(CUmemAllocationProp, allocFlags);
	O(CUmemAllocationProp, allocFlags.compressionType); O(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
	O(CUmemAllocationProp, allocFlags.usage);
	S(CUmemAccessDesc); O(CUmemAccessDesc, location); O(CUmemAccessDesc, flags);
	S(CUuuid); S(CUdevice); S(CUdeviceptr); S(CUmemGenericAllocationHandle); S(CUresult);
	S(cudaError_t); S(cudaStream_t); S(cudaEvent_t); S(cudaMemPool_t);
	E(cudaSuccess); E(cudaErrorInvalidResourceHandle); E(cudaErrorNotReady);
	E(cudaMemcpyHostToDevice); E(cudaMemcpyDeviceToHost); E(cudaStreamNonBlocking); E(cudaEventDisableTiming);
	E(cudaMemcpyDeviceToDevice); E(cudaHostAllocPortable); E(cudaHostAllocMapped); E(cudaHostAllocWriteCombined);
	E(cudaMemPoolAttrReleaseThreshold); E(cudaMemPoolAttrReservedMemCurrent); E(cudaMemPoolAttrUsedMemCurrent);
	E(cudaStreamLegacy); E(cudaStreamPerThread);
	E(CUDA_SUCCESS); E(CU_MEM_ALLOCATION_TYPE_PINNED); E(CU_MEM_HANDLE_TYPE_NONE); E(CU_MEM_LOCATION_TYPE_DEVICE);
	E(CU_MEM_ACCESS_FLAGS_PROT_READWRITE); E(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	E(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED); E(CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED);
	/* error codes cudart's Go side relies on (errors_cuda.go: abiErrorNames) */
	E(cudaErrorInvalidValue); E(cudaErrorMemoryAllocation); E(cudaErrorInitializationError);
	E(cudaErrorStubLibrary); E(cudaErrorInsufficientDriver); E(cudaErrorNoDevice); E(cudaErrorInvalidDevice);
	E(cudaErrorContained); E(cudaErrorIllegalAddress); E(cudaErrorLaunchTimeout); E(cudaErrorAssert);
	E(cudaErrorHardwareStackError); E(cudaErrorIllegalInstruction); E(cudaErrorMisalignedAddress);
	E(cudaErrorInvalidAddressSpace); E(cudaErrorInvalidPc); E(cudaErrorLaunchFailure);
	E(cudaErrorTensorMemoryLeak); E(cudaErrorSystemNotReady); E(cudaErrorSystemDriverMismatch);
	E(cudaErrorCompatNotSupportedOnDevice); E(cudaErrorExternalDevice); E(cudaErrorUnknown);
	E(CUDA_ERROR_INVALID_VALUE); E(CUDA_ERROR_OUT_OF_MEMORY); E(CUDA_ERROR_NO_DEVICE);
	E(CUDA_ERROR_INVALID_HANDLE); E(CUDA_ERROR_ILLEGAL_ADDRESS); E(CUDA_ERROR_LAUNCH_FAILED);
	E(CUDA_ERROR_CONTAINED); E(CUDA_ERROR_TENSOR_MEMORY_LEAK); E(CUDA_ERROR_EXTERNAL_DEVICE);
	return 0;
}
