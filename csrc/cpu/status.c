/* status.c - names of the dsv_status codes. */
#include "dsv.h"

const char* dsv_status_string(int status) {
  switch (status) {
    case DSV_OK: return "ok";
    case DSV_ERR_INVALID: return "invalid argument (out of its documented range)";
    case DSV_ERR_UNSUPPORTED: return "unsupported dtype, head dim or group size for this device";
    case DSV_ERR_CUDA: return "CUDA launch or call failed";
    case DSV_ERR_NOMEM: return "host allocation failed or workspace too small";
    case DSV_ERR_TUNING:
      return "DSV_KERNEL_TUNING is malformed: expected key=value,... with the keys sm_count, "
             "l2_bytes, wgmma, km_wgmma, g128, km_ratio, bwd_ranges, bwd_rmax, tk_gpw, tk_sample, "
             "tk_split and numbers in their ranges";
    default: return "unknown dsv status";
  }
}
