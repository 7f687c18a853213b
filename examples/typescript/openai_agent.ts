// An agent on the `openai` npm client with one tool, in its own process: no tracerl inside.
// Run by a tracerl rollout with the rollout's gateway in its environment (OPENAI_BASE_URL,
// OPENAI_API_KEY, TRACERL_MODEL): every call it makes joins that rollout's trajectory.
//
//   npx tsx openai_agent.ts "Add 17 and 25."
import OpenAI from "openai";

const tools: OpenAI.Chat.ChatCompletionTool[] = [{
  type: "function",
  function: {
    name: "add",
    description: "Add two integers.",
    parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } }, required: ["a", "b"] },
  },
}];

function add(args: string): string {
  try {
    const { a, b } = JSON.parse(args);
    return Number.isInteger(a) && Number.isInteger(b) ? String(a + b) : "error: add needs integers a and b";
  } catch {
    return "error: the arguments are not JSON";
  }
}

const client = new OpenAI({ maxRetries: 0, timeout: 300_000 }); // base URL and key from the environment
const messages: OpenAI.Chat.ChatCompletionMessageParam[] = [
  { role: "system", content: "You add numbers with the add tool, then answer with the sum." },
  { role: "user", content: process.argv[2] ?? "Add 2 and 3." },
];
for (let turn = 0; turn < 3; turn++) {
  const answer = await client.chat.completions.create({
    model: process.env.TRACERL_MODEL ?? "policy", messages, tools, max_tokens: 48, temperature: 1.0,
  });
  const message = answer.choices[0].message;
  messages.push(message);
  if (!message.tool_calls?.length) break;
  for (const call of message.tool_calls) {
    if (call.type !== "function") continue;
    messages.push({ role: "tool", tool_call_id: call.id, content: add(call.function.arguments) });
  }
}
const last = messages[messages.length - 1];
console.log(JSON.stringify({ answer: typeof last.content === "string" ? last.content : "" }));
