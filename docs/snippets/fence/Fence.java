// Fenced writes next to lease-sidecar: the database refuses a stale leader's token.
// Java 11+ and the PostgreSQL JDBC driver: `java -cp postgresql.jar Fence.java`.
import java.net.URI;
import java.net.http.HttpClient;
import java.net.http.HttpRequest;
import java.net.http.HttpResponse;
import java.sql.Connection;
import java.sql.DriverManager;
import java.sql.PreparedStatement;
import java.sql.SQLException;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

public class Fence {
    // The body is flat JSON; use your JSON library instead of these in real code.
    static final Pattern LEADER = Pattern.compile("\"leader\": true");
    static final Pattern LEASE = Pattern.compile("\"lease\": \"([^\"]*)\"");
    static final Pattern TOKEN = Pattern.compile("\"fencing_token\": (\\d+)");
    static final Pattern UNTIL = Pattern.compile("\"valid_until_ms\": (\\d+)");

    static String field(Pattern pattern, String body) {
        Matcher m = pattern.matcher(body);
        return m.find() ? m.group(1) : "0";
    }

    // One unit of work in one transaction, guarded by the token: the guard comes first,
    // and refuses (SQLSTATE LF001) once a newer leader has written.
    static void fencedWrite(Connection db, String lease, long token) throws SQLException {
        db.setAutoCommit(false);
        try (PreparedStatement fence = db.prepareStatement("SELECT lease.lease_fence(?, ?)");
             PreparedStatement write = db.prepareStatement("INSERT INTO writes (token) VALUES (?)")) {
            fence.setString(1, lease);
            fence.setLong(2, token);
            fence.execute();
            write.setLong(1, token);
            write.executeUpdate();
            db.commit();
        } catch (SQLException e) {
            db.rollback();
            throw e;
        }
    }

    public static void main(String[] args) throws Exception {
        String url = System.getenv().getOrDefault("LEASE_LEADER_URL",
                                                  "http://127.0.0.1:8099/leader");
        String body = HttpClient.newHttpClient().send(  // 503 carries the same JSON
            HttpRequest.newBuilder(URI.create(url)).build(),
            HttpResponse.BodyHandlers.ofString()).body();
        long token = Long.parseLong(field(TOKEN, body));
        if (!LEADER.matcher(body).find()
                || System.currentTimeMillis() >= Long.parseLong(field(UNTIL, body))) {
            System.out.println("not leader");
            System.exit(4);
        }
        try (Connection db = DriverManager.getConnection(System.getenv("JDBC_URL"))) {
            fencedWrite(db, field(LEASE, body), token);
            System.out.printf("wrote token=%d%n", token);
        } catch (SQLException e) {
            if (!"LF001".equals(e.getSQLState())) {
                throw e;
            }
            System.out.printf("refused token=%d sqlstate=%s%n", token, e.getSQLState());
            System.exit(3);
        }
    }
}
