// Singleton work next to lease-sidecar: only while this pod leads, token downstream.
// Java 11+, no dependencies; run with `java Worker.java`.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.time.Duration;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Worker {
    // The body is flat JSON; use your JSON library instead of these in real code.
    static final Pattern LEADER = Pattern.compile("\"leader\": true");
    static final Pattern TOKEN = Pattern.compile("\"fencing_token\": (\\d+)");
    static final Pattern UNTIL = Pattern.compile("\"valid_until_ms\": (\\d+)");

    // One short unit of work. Send the token with every write; the store refuses a
    // token smaller than the largest it has seen (a paused ex-leader).
    static void work(long token, long nowMs, long untilMs) throws InterruptedException {
        System.out.printf("work token=%d now_ms=%d until_ms=%d%n", token, nowMs, untilMs);
        Thread.sleep(100);
    }

    static long number(Pattern pattern, String body) {
        Matcher m = pattern.matcher(body);
        return m.find() ? Long.parseLong(m.group(1)) : 0;
    }

    public static void main(String[] args) throws InterruptedException {
        String url = System.getenv().getOrDefault("LEASE_LEADER_URL",
                                                  "http://127.0.0.1:8099/leader");
        HttpClient client = HttpClient.newHttpClient();
        String etag = null;
        boolean leading = false;
        while (true) {
            // Standby: block in the sidecar until the answer changes. Leading: ask
            // again before each unit, since one claim lasts only until its valid_until.
            int wait = leading ? 0 : 30;
            HttpRequest.Builder request = HttpRequest.newBuilder(URI.create(url + "?wait=" + wait))
                .timeout(Duration.ofSeconds(wait + 5));
            if (etag != null) {
                request.header("If-None-Match", etag);
            }
            String body = "";
            try {
                HttpResponse<String> response =
                    client.send(request.build(), HttpResponse.BodyHandlers.ofString());
                etag = response.headers().firstValue("ETag").orElse(null);
                body = response.body();
            } catch (java.io.IOException e) { // no sidecar: not leader
                etag = null;
                Thread.sleep(1000);
            }
            long now = System.currentTimeMillis();
            long until = number(UNTIL, body);
            boolean leader = LEADER.matcher(body).find();
            if (leader && now < until) {
                work(number(TOKEN, body), now, until);
            } else if (leading && !leader) {
                System.out.println("standby");
            }
            // A "yes" that arrived too late to use (past valid_until_ms) is no work,
            // but still a reason to ask again at once rather than long-poll.
            leading = leader;
        }
    }
}
