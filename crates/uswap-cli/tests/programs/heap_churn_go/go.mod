module heapchurn

go 1.19
