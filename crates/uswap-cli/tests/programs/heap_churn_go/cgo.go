// Linking the C library (only built when cgo is on): the runtime then allocates through it.
package main

// int uswap_cgo_marker(void) { return 1; }
import "C"

var _ = C.uswap_cgo_marker
