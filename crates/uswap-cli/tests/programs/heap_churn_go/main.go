// Builds an object graph of MiB mebibytes (1 KiB leaves, 64 to a chunk), churns a quarter of
// it twice with a collection after each round, checks every byte, and prints the peak
// RssAnon it saw: `ok MiB MiB peak-rss-anon-mib N`. Usage: heap_churn MiB. Built with cgo
// (cgo.go) its runtime maps memory through the C library; built with CGO_ENABLED=0 it is
// static, and `uswap run` refuses it.
package main

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
)

func peakAnon() int {
	b, _ := os.ReadFile("/proc/self/status")
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "RssAnon:") {
			n, _ := strconv.Atoi(strings.Fields(l)[1])
			return n >> 10
		}
	}
	return -1
}

func leaf(c, i, gen int) []byte {
	b := make([]byte, 1024)
	x := uint64(c*131071+i)*0x9E3779B97F4A7C15 + uint64(gen)
	for k := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[k] = byte(x)
	}
	return b
}

func main() {
	mib, _ := strconv.Atoi(os.Args[1])
	chunks := mib * 16
	graph := make([][][]byte, chunks)
	gen := make([]int, chunks)
	peak := 0
	for c := range graph {
		graph[c] = make([][]byte, 64)
		for i := range graph[c] {
			graph[c][i] = leaf(c, i, 0)
		}
		if c%1024 == 0 {
			if p := peakAnon(); p > peak {
				peak = p
			}
		}
	}
	seed := uint64(42)
	for round := 0; round < 2; round++ {
		for n := 0; n < chunks/4; n++ {
			seed = seed*6364136223846793005 + 1442695040888963407
			c := int(seed>>33) % chunks
			gen[c]++
			for i := range graph[c] {
				graph[c][i] = leaf(c, i, gen[c])
			}
		}
		runtime.GC()
		if p := peakAnon(); p > peak {
			peak = p
		}
	}
	for c := range graph {
		for i := range graph[c] {
			want := leaf(c, i, gen[c])
			for k := range want {
				if graph[c][i][k] != want[k] {
					fmt.Printf("mismatch chunk %d leaf %d\n", c, i)
					os.Exit(1)
				}
			}
		}
	}
	fmt.Printf("ok %d MiB peak-rss-anon-mib %d\n", mib, peak)
}
