import java.nio.file.*;
import java.util.*;

/** Builds an object graph of MiB mebibytes (chunks of 64 KiB made of 1 KiB arrays),
 *  churns it (replaces a quarter, drops, collects), verifies every byte, and prints the
 *  peak RssAnon it saw. Usage: java HeapChurn MiB */
public class HeapChurn {
    static long peakKib = 0;
    static void sample() throws Exception {
        for (String l : Files.readAllLines(Paths.get("/proc/self/status")))
            if (l.startsWith("RssAnon:")) peakKib = Math.max(peakKib, Long.parseLong(l.replaceAll("[^0-9]", "")));
    }
    static byte[] leaf(int chunk, int i, int gen) {
        byte[] b = new byte[1024];
        long x = (chunk * 131071L + i) * 0x9E3779B97F4A7C15L + gen;
        for (int k = 0; k < b.length; k++) { x ^= x << 13; x ^= x >>> 7; x ^= x << 17; b[k] = (byte) x; }
        return b;
    }
    public static void main(String[] a) throws Exception {
        int mib = Integer.parseInt(a[0]);
        int chunks = mib * 16; // 64 KiB each
        byte[][][] graph = new byte[chunks][][];
        int[] gen = new int[chunks];
        for (int c = 0; c < chunks; c++) {
            graph[c] = new byte[64][];
            for (int i = 0; i < 64; i++) graph[c][i] = leaf(c, i, 0);
            if (c % 1024 == 0) sample();
        }
        Random r = new Random(42);
        for (int round = 0; round < 2; round++) {
            for (int n = 0; n < chunks / 4; n++) {
                int c = r.nextInt(chunks);
                gen[c]++;
                for (int i = 0; i < 64; i++) graph[c][i] = leaf(c, i, gen[c]);
            }
            System.gc();
            sample();
        }
        for (int c = 0; c < chunks; c++)
            for (int i = 0; i < 64; i++)
                if (!Arrays.equals(graph[c][i], leaf(c, i, gen[c]))) {
                    System.out.println("mismatch chunk " + c + " leaf " + i); System.exit(1);
                }
        sample();
        System.out.println("ok " + mib + " MiB peak-rss-anon-mib " + (peakKib >> 10));
    }
}
