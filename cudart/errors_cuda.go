package cudart

import (
	"fmt"
	"strings"
)

// runtimeErrorNames maps cudaError_t codes to their enum names
// (driver_types.h, CUDA 13.0). Errors carry these names even when the loaded
// runtime is older than the code or cudaGetErrorName cannot be called.
var runtimeErrorNames = map[int]string{
	0:   "cudaSuccess",
	1:   "cudaErrorInvalidValue",
	2:   "cudaErrorMemoryAllocation",
	3:   "cudaErrorInitializationError",
	4:   "cudaErrorCudartUnloading",
	5:   "cudaErrorProfilerDisabled",
	6:   "cudaErrorProfilerNotInitialized",
	7:   "cudaErrorProfilerAlreadyStarted",
	8:   "cudaErrorProfilerAlreadyStopped",
	9:   "cudaErrorInvalidConfiguration",
	12:  "cudaErrorInvalidPitchValue",
	13:  "cudaErrorInvalidSymbol",
	16:  "cudaErrorInvalidHostPointer",
	17:  "cudaErrorInvalidDevicePointer",
	18:  "cudaErrorInvalidTexture",
	19:  "cudaErrorInvalidTextureBinding",
	20:  "cudaErrorInvalidChannelDescriptor",
	21:  "cudaErrorInvalidMemcpyDirection",
	22:  "cudaErrorAddressOfConstant",
	23:  "cudaErrorTextureFetchFailed",
	24:  "cudaErrorTextureNotBound",
	25:  "cudaErrorSynchronizationError",
	26:  "cudaErrorInvalidFilterSetting",
	27:  "cudaErrorInvalidNormSetting",
	28:  "cudaErrorMixedDeviceExecution",
	31:  "cudaErrorNotYetImplemented",
	32:  "cudaErrorMemoryValueTooLarge",
	34:  "cudaErrorStubLibrary",
	35:  "cudaErrorInsufficientDriver",
	36:  "cudaErrorCallRequiresNewerDriver",
	37:  "cudaErrorInvalidSurface",
	43:  "cudaErrorDuplicateVariableName",
	44:  "cudaErrorDuplicateTextureName",
	45:  "cudaErrorDuplicateSurfaceName",
	46:  "cudaErrorDevicesUnavailable",
	49:  "cudaErrorIncompatibleDriverContext",
	52:  "cudaErrorMissingConfiguration",
	53:  "cudaErrorPriorLaunchFailure",
	65:  "cudaErrorLaunchMaxDepthExceeded",
	66:  "cudaErrorLaunchFileScopedTex",
	67:  "cudaErrorLaunchFileScopedSurf",
	68:  "cudaErrorSyncDepthExceeded",
	69:  "cudaErrorLaunchPendingCountExceeded",
	98:  "cudaErrorInvalidDeviceFunction",
	100: "cudaErrorNoDevice",
	101: "cudaErrorInvalidDevice",
	102: "cudaErrorDeviceNotLicensed",
	103: "cudaErrorSoftwareValidityNotEstablished",
	127: "cudaErrorStartupFailure",
	200: "cudaErrorInvalidKernelImage",
	201: "cudaErrorDeviceUninitialized",
	205: "cudaErrorMapBufferObjectFailed",
	206: "cudaErrorUnmapBufferObjectFailed",
	207: "cudaErrorArrayIsMapped",
	208: "cudaErrorAlreadyMapped",
	209: "cudaErrorNoKernelImageForDevice",
	210: "cudaErrorAlreadyAcquired",
	211: "cudaErrorNotMapped",
	212: "cudaErrorNotMappedAsArray",
	213: "cudaErrorNotMappedAsPointer",
	214: "cudaErrorECCUncorrectable",
	215: "cudaErrorUnsupportedLimit",
	216: "cudaErrorDeviceAlreadyInUse",
	217: "cudaErrorPeerAccessUnsupported",
	218: "cudaErrorInvalidPtx",
	219: "cudaErrorInvalidGraphicsContext",
	220: "cudaErrorNvlinkUncorrectable",
	221: "cudaErrorJitCompilerNotFound",
	222: "cudaErrorUnsupportedPtxVersion",
	223: "cudaErrorJitCompilationDisabled",
	224: "cudaErrorUnsupportedExecAffinity",
	225: "cudaErrorUnsupportedDevSideSync",
	226: "cudaErrorContained",
	300: "cudaErrorInvalidSource",
	301: "cudaErrorFileNotFound",
	302: "cudaErrorSharedObjectSymbolNotFound",
	303: "cudaErrorSharedObjectInitFailed",
	304: "cudaErrorOperatingSystem",
	400: "cudaErrorInvalidResourceHandle",
	401: "cudaErrorIllegalState",
	402: "cudaErrorLossyQuery",
	500: "cudaErrorSymbolNotFound",
	600: "cudaErrorNotReady",
	700: "cudaErrorIllegalAddress",
	701: "cudaErrorLaunchOutOfResources",
	702: "cudaErrorLaunchTimeout",
	703: "cudaErrorLaunchIncompatibleTexturing",
	704: "cudaErrorPeerAccessAlreadyEnabled",
	705: "cudaErrorPeerAccessNotEnabled",
	708: "cudaErrorSetOnActiveProcess",
	709: "cudaErrorContextIsDestroyed",
	710: "cudaErrorAssert",
	711: "cudaErrorTooManyPeers",
	712: "cudaErrorHostMemoryAlreadyRegistered",
	713: "cudaErrorHostMemoryNotRegistered",
	714: "cudaErrorHardwareStackError",
	715: "cudaErrorIllegalInstruction",
	716: "cudaErrorMisalignedAddress",
	717: "cudaErrorInvalidAddressSpace",
	718: "cudaErrorInvalidPc",
	719: "cudaErrorLaunchFailure",
	720: "cudaErrorCooperativeLaunchTooLarge",
	721: "cudaErrorTensorMemoryLeak",
	800: "cudaErrorNotPermitted",
	801: "cudaErrorNotSupported",
	802: "cudaErrorSystemNotReady",
	803: "cudaErrorSystemDriverMismatch",
	804: "cudaErrorCompatNotSupportedOnDevice",
	805: "cudaErrorMpsConnectionFailed",
	806: "cudaErrorMpsRpcFailure",
	807: "cudaErrorMpsServerNotReady",
	808: "cudaErrorMpsMaxClientsReached",
	809: "cudaErrorMpsMaxConnectionsReached",
	810: "cudaErrorMpsClientTerminated",
	811: "cudaErrorCdpNotSupported",
	812: "cudaErrorCdpVersionMismatch",
	900: "cudaErrorStreamCaptureUnsupported",
	901: "cudaErrorStreamCaptureInvalidated",
	902: "cudaErrorStreamCaptureMerge",
	903: "cudaErrorStreamCaptureUnmatched",
	904: "cudaErrorStreamCaptureUnjoined",
	905: "cudaErrorStreamCaptureIsolation",
	906: "cudaErrorStreamCaptureImplicit",
	907: "cudaErrorCapturedEvent",
	908: "cudaErrorStreamCaptureWrongThread",
	909: "cudaErrorTimeout",
	910: "cudaErrorGraphExecUpdateFailure",
	911: "cudaErrorExternalDevice",
	912: "cudaErrorInvalidClusterSize",
	913: "cudaErrorFunctionNotLoaded",
	914: "cudaErrorInvalidResourceType",
	915: "cudaErrorInvalidResourceConfiguration",
	999: "cudaErrorUnknown",
}

// driverErrorNames maps CUresult codes to their enum names (cuda.h, CUDA
// 13.0). The driver and runtime agree on the numbers of the errors cudart
// cares about (2 is out of memory in both, 700-721 are the device
// exceptions in both), but not on the names.
var driverErrorNames = map[int]string{
	0:   "CUDA_SUCCESS",
	1:   "CUDA_ERROR_INVALID_VALUE",
	2:   "CUDA_ERROR_OUT_OF_MEMORY",
	3:   "CUDA_ERROR_NOT_INITIALIZED",
	4:   "CUDA_ERROR_DEINITIALIZED",
	5:   "CUDA_ERROR_PROFILER_DISABLED",
	6:   "CUDA_ERROR_PROFILER_NOT_INITIALIZED",
	7:   "CUDA_ERROR_PROFILER_ALREADY_STARTED",
	8:   "CUDA_ERROR_PROFILER_ALREADY_STOPPED",
	34:  "CUDA_ERROR_STUB_LIBRARY",
	46:  "CUDA_ERROR_DEVICE_UNAVAILABLE",
	100: "CUDA_ERROR_NO_DEVICE",
	101: "CUDA_ERROR_INVALID_DEVICE",
	102: "CUDA_ERROR_DEVICE_NOT_LICENSED",
	200: "CUDA_ERROR_INVALID_IMAGE",
	201: "CUDA_ERROR_INVALID_CONTEXT",
	202: "CUDA_ERROR_CONTEXT_ALREADY_CURRENT",
	205: "CUDA_ERROR_MAP_FAILED",
	206: "CUDA_ERROR_UNMAP_FAILED",
	207: "CUDA_ERROR_ARRAY_IS_MAPPED",
	208: "CUDA_ERROR_ALREADY_MAPPED",
	209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
	210: "CUDA_ERROR_ALREADY_ACQUIRED",
	211: "CUDA_ERROR_NOT_MAPPED",
	212: "CUDA_ERROR_NOT_MAPPED_AS_ARRAY",
	213: "CUDA_ERROR_NOT_MAPPED_AS_POINTER",
	214: "CUDA_ERROR_ECC_UNCORRECTABLE",
	215: "CUDA_ERROR_UNSUPPORTED_LIMIT",
	216: "CUDA_ERROR_CONTEXT_ALREADY_IN_USE",
	217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
	218: "CUDA_ERROR_INVALID_PTX",
	219: "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT",
	220: "CUDA_ERROR_NVLINK_UNCORRECTABLE",
	221: "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
	222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
	223: "CUDA_ERROR_JIT_COMPILATION_DISABLED",
	224: "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY",
	225: "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC",
	226: "CUDA_ERROR_CONTAINED",
	300: "CUDA_ERROR_INVALID_SOURCE",
	301: "CUDA_ERROR_FILE_NOT_FOUND",
	302: "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND",
	303: "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED",
	304: "CUDA_ERROR_OPERATING_SYSTEM",
	400: "CUDA_ERROR_INVALID_HANDLE",
	401: "CUDA_ERROR_ILLEGAL_STATE",
	402: "CUDA_ERROR_LOSSY_QUERY",
	500: "CUDA_ERROR_NOT_FOUND",
	600: "CUDA_ERROR_NOT_READY",
	700: "CUDA_ERROR_ILLEGAL_ADDRESS",
	701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
	702: "CUDA_ERROR_LAUNCH_TIMEOUT",
	703: "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING",
	704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
	705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
	708: "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE",
	709: "CUDA_ERROR_CONTEXT_IS_DESTROYED",
	710: "CUDA_ERROR_ASSERT",
	711: "CUDA_ERROR_TOO_MANY_PEERS",
	712: "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
	713: "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
	714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
	715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
	716: "CUDA_ERROR_MISALIGNED_ADDRESS",
	717: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
	718: "CUDA_ERROR_INVALID_PC",
	719: "CUDA_ERROR_LAUNCH_FAILED",
	720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
	721: "CUDA_ERROR_TENSOR_MEMORY_LEAK",
	800: "CUDA_ERROR_NOT_PERMITTED",
	801: "CUDA_ERROR_NOT_SUPPORTED",
	802: "CUDA_ERROR_SYSTEM_NOT_READY",
	803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
	804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
	805: "CUDA_ERROR_MPS_CONNECTION_FAILED",
	806: "CUDA_ERROR_MPS_RPC_FAILURE",
	807: "CUDA_ERROR_MPS_SERVER_NOT_READY",
	808: "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
	809: "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
	810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
	811: "CUDA_ERROR_CDP_NOT_SUPPORTED",
	812: "CUDA_ERROR_CDP_VERSION_MISMATCH",
	900: "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
	901: "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
	902: "CUDA_ERROR_STREAM_CAPTURE_MERGE",
	903: "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
	904: "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
	905: "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
	906: "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
	907: "CUDA_ERROR_CAPTURED_EVENT",
	908: "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
	909: "CUDA_ERROR_TIMEOUT",
	910: "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE",
	911: "CUDA_ERROR_EXTERNAL_DEVICE",
	912: "CUDA_ERROR_INVALID_CLUSTER_SIZE",
	913: "CUDA_ERROR_FUNCTION_NOT_LOADED",
	914: "CUDA_ERROR_INVALID_RESOURCE_TYPE",
	915: "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION",
	916: "CUDA_ERROR_KEY_ROTATION",
	999: "CUDA_ERROR_UNKNOWN",
}

// errorTexts holds cudaGetErrorString's description of the codes cudart
// meets most, for when the library cannot describe them itself.
var errorTexts = map[int]string{
	1:   "invalid argument",
	2:   "out of memory",
	3:   "initialization error",
	35:  "CUDA driver version is insufficient for CUDA runtime version",
	100: "no CUDA-capable device is detected",
	101: "invalid device ordinal",
	400: "invalid resource handle",
	600: "device not ready",
	700: "an illegal memory access was encountered",
	719: "unspecified launch failure",
	801: "operation not supported",
	999: "unknown error",
}

// stickyCodes are the errors CUDA documents as leaving the process in an
// inconsistent state ("any further CUDA work will return the same error. To
// continue using CUDA, the process must be terminated and relaunched"):
// the device exceptions 700, 702, 710, 714-719 and 721, error containment
// (226) and external-device faults (911). The numbers are the same for the
// runtime (cudaError*) and the driver (CUDA_ERROR_*).
var stickyCodes = map[int]bool{
	226: true, // cudaErrorContained
	700: true, // cudaErrorIllegalAddress
	702: true, // cudaErrorLaunchTimeout
	710: true, // cudaErrorAssert
	714: true, // cudaErrorHardwareStackError
	715: true, // cudaErrorIllegalInstruction
	716: true, // cudaErrorMisalignedAddress
	717: true, // cudaErrorInvalidAddressSpace
	718: true, // cudaErrorInvalidPc
	719: true, // cudaErrorLaunchFailure
	721: true, // cudaErrorTensorMemoryLeak
	911: true, // cudaErrorExternalDevice
}

// noDriverCodes are the codes that mean "no usable CUDA driver or device",
// which Open and DeviceCount report as wrapping ErrNoDriver: uninitialised
// (3), stub library (34), driver older than the runtime (35), no device
// (100), system not ready / driver mismatch / compat unsupported (802-804).
var noDriverCodes = map[int]bool{3: true, 34: true, 35: true, 100: true, 802: true, 803: true, 804: true}

// errorName returns the enum name of code, from the runtime table or, for a
// driver code, the driver table; "cudaError(N)" / "CUresult(N)" when unknown.
func errorName(code int, driver bool) string {
	if driver {
		if n, ok := driverErrorNames[code]; ok {
			return n
		}
		return fmt.Sprintf("CUresult(%d)", code)
	}
	if n, ok := runtimeErrorNames[code]; ok {
		return n
	}
	return fmt.Sprintf("cudaError(%d)", code)
}

// newCUDAError builds the error for a failed CUDA call. name and text are
// what the library said (empty when it could not say); unknown or
// unhelpful answers are replaced from the tables above.
func newCUDAError(op string, code int, driver bool, name, text string) *CUDAError {
	if name == "" || strings.Contains(name, "unrecognized") {
		name = errorName(code, driver)
	}
	if text == "" || strings.Contains(text, "unrecognized error code") {
		if t, ok := errorTexts[code]; ok {
			text = t
		} else {
			text = fmt.Sprintf("CUDA error %d", code)
		}
	}
	return &CUDAError{Op: op, Code: code, Name: name, Text: text, Sticky: stickyCodes[code]}
}

// abiErrorNames are the error enums whose values cudart's Go side relies
// on (OOM detection, ErrInvalidValue, ErrNoDriver, the sticky set);
// ABIAssumptions reports them and abicheck.c prints them from the headers.
var abiErrorNames = []string{
	"cudaErrorInvalidValue", "cudaErrorMemoryAllocation", "cudaErrorInitializationError",
	"cudaErrorStubLibrary", "cudaErrorInsufficientDriver", "cudaErrorNoDevice", "cudaErrorInvalidDevice",
	"cudaErrorContained", "cudaErrorIllegalAddress", "cudaErrorLaunchTimeout", "cudaErrorAssert",
	"cudaErrorHardwareStackError", "cudaErrorIllegalInstruction", "cudaErrorMisalignedAddress",
	"cudaErrorInvalidAddressSpace", "cudaErrorInvalidPc", "cudaErrorLaunchFailure",
	"cudaErrorTensorMemoryLeak", "cudaErrorSystemNotReady", "cudaErrorSystemDriverMismatch",
	"cudaErrorCompatNotSupportedOnDevice", "cudaErrorExternalDevice", "cudaErrorUnknown",
	"CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_NO_DEVICE",
	"CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
	"CUDA_ERROR_CONTAINED", "CUDA_ERROR_TENSOR_MEMORY_LEAK", "CUDA_ERROR_EXTERNAL_DEVICE",
}

// goABIAssumptions returns the codes of abiErrorNames as this package's
// tables have them.
func goABIAssumptions() map[string]int64 {
	byName := make(map[string]int64, len(runtimeErrorNames)+len(driverErrorNames))
	for c, n := range runtimeErrorNames {
		byName[n] = int64(c)
	}
	for c, n := range driverErrorNames {
		byName[n] = int64(c)
	}
	m := make(map[string]int64, len(abiErrorNames))
	for _, n := range abiErrorNames {
		if c, ok := byName[n]; ok {
			m[n] = c
		}
	}
	return m
}
